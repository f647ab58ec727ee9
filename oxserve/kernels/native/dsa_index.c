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
#include "vmath.h"

#define MAX_DIM 1024 /* index head dim; NATIVE_MAX_DIM in kernels/dsa_index.py */

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
