/* DSA indexer scores of decoding queries over their requests' compressed pool keys, read from
 * the paged pool-key cache in place (torch gathers a [T, P, D] copy first).
 *
 * Query t (of request request[t]) sees its first visible[t] pools; pool p of request r lives
 * in pool row block_tables[r][p / ppb] * ppb + p % ppb (ppb: pools per block). Per pool:
 *
 *   score[t][p] = sum_h w[t][h] * relu(scale * q[t][h] . key_p)     p < visible[t], else `hidden`
 *
 * q, w and scores fp32; keys bf16 when `bf16`, else fp32. `hidden`: 0, or -inf for a top-k to skip.
 * Queries are spread over threads.
 */
#include <stdint.h>

#include "bf16.h"
#include "vmath.h"

#define MAX_DIM 1024 /* index head dim; NATIVE_MAX_DIM in kernels/dsa_index.py */

int dsa_index_scores(const float *q, const float *head_weights, const int64_t *visible, const int64_t *request,
                     const int64_t *block_tables, int64_t max_blocks, int64_t pools_per_block, const void *pool_keys,
                     int bf16, int64_t tokens, int heads, int64_t dim, int64_t num_pools, float scale, float hidden,
                     float *out, int threads) {
    if (dim > MAX_DIM) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t *table = block_tables + request[t] * max_blocks;
        const float *qt = q + t * heads * dim, *wt = head_weights + t * heads;
        float key[MAX_DIM];
        float *row_out = out + t * num_pools;
        for (int64_t p = 0; p < num_pools; p++) {
            if (p >= visible[t]) {
                row_out[p] = hidden;
                continue;
            }
            const int64_t row = table[p / pools_per_block] * pools_per_block + p % pools_per_block;
            widen_row(pool_keys, row * dim, dim, bf16, key);
            float sum = 0.0f;
            for (int h = 0; h < heads; h++) {
                const float s = vdot(qt + h * dim, key, dim) * scale;
                sum += wt[h] * (s > 0.0f ? s : 0.0f);
            }
            row_out[p] = sum;
        }
    }
    return 0;
}

/* The positions a query attends to, from the pools top-k chose (chosen [T, k], pool ids):
 *
 *   out[t][j P + o] = chosen[t][j] P + o     for o < P, or -1 where pool chosen[t][j] is not
 *                                            visible to query t (top-k filled up with it)
 *   then, with `tail`, P - 1 entries: visible[t] P + o for o < P - 1 where <= pos[t], else -1
 *
 * (`Indexer._select`'s torch form: about 15 eager ops.) out [T, k P + (tail ? P - 1 : 0)]. */
void dsa_expand_selection(const int64_t *chosen, int64_t tokens, int64_t k, const int64_t *visible, const int64_t *pos,
                          int64_t pool, int tail, int64_t *out) {
    const int64_t width = k * pool + (tail ? pool - 1 : 0);
    for (int64_t t = 0; t < tokens; t++) {
        int64_t *row = out + t * width;
        for (int64_t j = 0; j < k; j++) {
            const int64_t c = chosen[t * k + j];
            for (int64_t o = 0; o < pool; o++) row[j * pool + o] = c < visible[t] ? c * pool + o : -1;
        }
        if (tail)
            for (int64_t o = 0; o < pool - 1; o++) {
                const int64_t p = visible[t] * pool + o;
                row[k * pool + o] = p <= pos[t] ? p : -1;
            }
    }
}
