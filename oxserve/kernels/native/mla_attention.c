/* MLA attention in latent space over each query's selected positions, reading the paged
 * latent cache in place: torch gathers a [T, K, C] copy of the selected latents first and
 * runs ~10 ops over it.
 *
 * Query t (of request request[t]) selected positions[t][0..K) (-1: nothing there); position
 * p lives in cache row block_tables[request][p / block_size] * block_size + p % block_size.
 * Per head h, over the selected positions k with latents c_k:
 *
 *   s_k = round(q[t,h] . c_k) * scale      (round: to the model dtype, as torch's product is)
 *   p   = round(softmax(s))
 *   out[t,h] = round(sum_k p_k c_k)        a query with nothing selected gets 0
 *
 * q, latent and out are bf16 when `bf16`, else fp32; sums are fp32. Queries are spread over
 * `threads` threads. Returns 0, or -2 without scratch memory.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vmath.h"


static inline float model_round(float x, int bf16) { return bf16 ? round_bf16(x) : x; }

int mla_latent_attention(const void *q, const void *latent, const int64_t *positions, int64_t width,
                         const int64_t *request, const int64_t *block_tables, int64_t max_blocks, int64_t block_size,
                         int64_t tokens, int heads, int64_t dim, float scale, int bf16, void *out, int threads) {
    if (threads < 1) threads = 1;
    const int64_t k_room = width > 0 ? width : 1;
    /* per thread: the query's heads [H][C], one latent row [C], scores [H][K], sums [H][C], rows [K] */
    const int64_t per_thread = 2 * heads * dim + dim + heads * k_room;
    float *scratch = malloc((size_t)(threads * per_thread) * sizeof(float));
    int64_t *rows_all = malloc((size_t)(threads * k_room) * sizeof(int64_t));
    if (scratch == NULL || rows_all == NULL) {
        free(scratch);
        free(rows_all);
        return -2;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const int id = omp_get_thread_num();
        float *qf = scratch + id * per_thread, *acc = qf + heads * dim, *row = acc + heads * dim, *score = row + dim;
        int64_t *rows = rows_all + id * k_room;
        const int64_t *pos = positions + t * width, *table = block_tables + request[t] * max_blocks;
        int64_t n = 0;
        for (int64_t k = 0; k < width; k++)
            if (pos[k] >= 0) rows[n++] = table[pos[k] / block_size] * block_size + pos[k] % block_size;
        widen_row(q, t * heads * dim, heads * dim, bf16, qf);
        for (int64_t k = 0; k < n; k++) {
            widen_row(latent, rows[k] * dim, dim, bf16, row);
            for (int h = 0; h < heads; h++) score[h * n + k] = model_round(vdot(qf + h * dim, row, dim), bf16) * scale;
        }
        for (int h = 0; h < heads; h++) {
            float *s = score + h * n, top = n > 0 ? s[0] : 0.0f, total = 0.0f;
            for (int64_t k = 1; k < n; k++) top = s[k] > top ? s[k] : top;
            for (int64_t k = 0; k < n; k++) {
                s[k] = vexp(s[k] - top);
                total += s[k];
            }
            for (int64_t k = 0; k < n; k++) s[k] = model_round(s[k] / total, bf16);
        }
        memset(acc, 0, (size_t)(heads * dim) * sizeof(float));
        for (int64_t k = 0; k < n; k++) {
            widen_row(latent, rows[k] * dim, dim, bf16, row);
            for (int h = 0; h < heads; h++) {
                const float p = score[h * n + k];
                float *restrict a = acc + h * dim;
                for (int64_t c = 0; c < dim; c++) a[c] += p * row[c];
            }
        }
        const int64_t at = t * heads * dim;
        if (bf16) {
            uint16_t *o = (uint16_t *)out + at;
            for (int64_t i = 0; i < heads * dim; i++) o[i] = f32_to_bf16(acc[i]);
        } else {
            memcpy((float *)out + at, acc, (size_t)(heads * dim) * sizeof(float));
        }
    }
    free(scratch);
    free(rows_all);
    return 0;
}
