/* DSA indexer scores of decoding queries over their requests' compressed pool keys, read from
 * the paged pool-key cache in place (torch gathers a [T, P, D] copy first).
 *
 * Query t (of request request[t]) sees its first visible[t] pools; pool p of request r lives
 * in pool row block_tables[r][p / ppb] * ppb + p % ppb (ppb: pools per block). Per pool:
 *
 *   score[t][p] = sum_h w[t][h] * relu(scale * q[t][h] . key_p)     p < visible[t], else 0
 *
 * q, w and scores fp32; keys bf16 when `bf16`, else fp32. Queries are spread over threads.
 */
#include <stdint.h>

#include "bf16.h"

#define SUMS 16 /* independent partial sums of a dot product: the adds vectorise */
#define MAX_DIM 1024 /* index head dim; NATIVE_MAX_DIM in kernels/dsa_index.py */

static float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float part[SUMS] = {0};
    int64_t i = 0;
    for (; i + SUMS <= n; i += SUMS)
        for (int l = 0; l < SUMS; l++) part[l] += a[i + l] * b[i + l];
    float sum = 0.0f;
    for (int l = 0; l < SUMS; l++) sum += part[l];
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

int dsa_index_scores(const float *q, const float *head_weights, const int64_t *visible, const int64_t *request,
                     const int64_t *block_tables, int64_t max_blocks, int64_t pools_per_block, const void *pool_keys,
                     int bf16, int64_t tokens, int heads, int64_t dim, int64_t num_pools, float scale, float *out,
                     int threads) {
    if (dim > MAX_DIM) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t *table = block_tables + request[t] * max_blocks;
        const float *qt = q + t * heads * dim, *wt = head_weights + t * heads;
        float key[MAX_DIM];
        float *row_out = out + t * num_pools;
        for (int64_t p = 0; p < num_pools; p++) {
            if (p >= visible[t]) {
                row_out[p] = 0.0f;
                continue;
            }
            const int64_t row = table[p / pools_per_block] * pools_per_block + p % pools_per_block;
            if (bf16) {
                const uint16_t *src = (const uint16_t *)pool_keys + row * dim;
                for (int64_t d = 0; d < dim; d++) key[d] = bf16_to_f32(src[d]);
            } else {
                const float *src = (const float *)pool_keys + row * dim;
                for (int64_t d = 0; d < dim; d++) key[d] = src[d];
            }
            float sum = 0.0f;
            for (int h = 0; h < heads; h++) {
                const float s = dot(qt + h * dim, key, dim) * scale;
                sum += wt[h] * (s > 0.0f ? s : 0.0f);
            }
            row_out[p] = sum;
        }
    }
    return 0;
}
