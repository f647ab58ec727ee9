/* DSA indexer scores of decoding queries over their requests' compressed pool keys, read from
 * the paged pool-key cache in place (torch gathers a [T, P, D] copy first).
 *
 * Query t (of request request[t], at position pos[t]) sees its first visible[t] = (pos[t] + 1) /
 * P pools (P: tokens a pool); pool p of request r lives
 * in pool row block_tables[r][p / ppb] * ppb + p % ppb (ppb: pools per block). Per pool:
 *
 *   score[t][p] = sum_h (weight_scale w[t][h]) * relu(scale * q[t][h] . key_p)     p < visible[t], else `hidden`
 *
 * q and w bf16 when `q_bf16`, else fp32 (as the projections give them; widened here); scores
 * fp32; keys bf16 when `bf16`, else fp32. `hidden`: 0, or -inf for a top-k to skip. An int8 or
 * fp8 key table (`key_kind`, one fp32 scale a row in `key_scales`) is read as torch reads it,
 * each value times its row's scale rounded to bf16 when `bf16` (`scaled_rows.h`).
 *
 * Tasks are (POOL_CHUNK pools, query), chunk by chunk, handed out round robin: one decode
 * query's row of a long context is thousands of pools, which one thread scored alone, and
 * numbered chunk-major every thread gets its share of each chunk however many rows there are
 * (a row's visible pools come first). A pool costs little arithmetic; its key waits on
 * memory (a block's pools lie together, blocks anywhere in the cache, so no hardware
 * prefetcher follows them: ~60 ns a pool at 16k tokens of context on a Zen 3 EPYC): at each
 * block's start the keys of the block AHEAD_BLOCKS - 1 on are asked for, so that AHEAD_BLOCKS
 * blocks are in flight.
 *
 * Pools are scored GROUP at a time, one a vector lane: their keys transposed to [dim][GROUP]
 * (on AVX-512, 16 key rows in registers), each head's dot products are multiply-adds of
 * a broadcast query value into a vector of GROUP sums (even and odd dims in two sums, added at
 * the end). A dot product a pool ended in a horizontal add of its vector, several times the
 * arithmetic: 60-120 cycles a pool with two heads of 32 dims. A lane's sums do not depend on
 * the other lanes, so a pool's score is the same whatever group or task it falls in.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "scaled_rows.h"
#include "scratch.h"
#include "transpose16.h"
#include "vmath.h"

#define MAX_DIM 1024     /* index head dim; NATIVE_MAX_DIM in kernels/dsa_index.py */
#define MAX_QUERY 16384  /* heads x head dim; NATIVE_MAX_QUERY in kernels/dsa_index.py */
#define MAX_HEADS 256    /* NATIVE_MAX_HEADS in kernels/dsa_index.py */
#define POOL_CHUNK 512   /* pools a task scores */
#define AHEAD_BLOCKS 4   /* blocks of pool keys in flight, the one being scored included */
#define GROUP 16         /* pools scored together, one a vector lane */


/* A key table: values of the model dtype (kind PLAIN), or int8/fp8 rows with a scale each
 * (`scaled_rows.h`), read and written in the model dtype. */
typedef struct {
    void *values;
    float *scales;
    int kind;
} KeyTable;

/* out [dim] = row `row` of the table, in the model dtype (bf16 when `bf16`), as fp32. */
static void read_keys(const KeyTable *table, int64_t row, int64_t dim, int bf16, float *out) {
    if (table->kind == PLAIN) {
        widen_row(table->values, row * dim, dim, bf16, out);
        return;
    }
    scaled_row(table->values, row * dim, dim, table->scales[row], table->kind, 0, out, 0);
    if (bf16)
        for (int64_t d = 0; d < dim; d++) out[d] = round_bf16(out[d]);
}

/* Row `row` of the table = x [dim] rounded to the model dtype (x rounded in place). */
static void write_keys(const KeyTable *table, int64_t row, int64_t dim, int bf16, float *x) {
    if (table->kind == PLAIN) {
        narrow_row(x, dim, bf16, table->values, row * dim);
        return;
    }
    if (bf16)
        for (int64_t d = 0; d < dim; d++) x[d] = round_bf16(x[d]);
    quantize_row(x, dim, table->kind, table->values, table->scales, row);
}

#define STAGED_DIM 256 /* scaled keys up to this wide are dequantized into rows, then transposed as a plain table's */

/* kt[d][l] = key d of row rows[l] of a plain table (`values` bf16 when `bf16`, else fp32),
 * widened to fp32, for l < count (<= GROUP); 0 past it. */
static void transpose_plain(const void *pool_keys, int bf16, const int64_t *rows, int count, int64_t dim,
                            float *restrict kt) {
    int64_t d0 = 0;
#if defined(__AVX512F__)
    if (bf16 && count == GROUP) /* 32 dims (16 pairs) of 16 rows a block: each 32-bit lane a pair */
        for (; d0 + 32 <= dim; d0 += 32) {
            __m512 r[16];
            for (int l = 0; l < 16; l++) r[l] = _mm512_loadu_ps((const uint16_t *)pool_keys + rows[l] * dim + d0);
            transpose16(r);
            const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
            for (int j = 0; j < 16; j++) {
                const __m512i pair = _mm512_castps_si512(r[j]);
                _mm512_storeu_si512(kt + (d0 + 2 * j) * GROUP, _mm512_slli_epi32(pair, 16));
                _mm512_storeu_si512(kt + (d0 + 2 * j + 1) * GROUP, _mm512_and_si512(pair, high));
            }
        }
    if (!bf16 && count == GROUP) /* 16 dims of 16 rows a block */
        for (; d0 + 16 <= dim; d0 += 16) {
            __m512 r[16];
            for (int l = 0; l < 16; l++) r[l] = _mm512_loadu_ps((const float *)pool_keys + rows[l] * dim + d0);
            transpose16(r);
            for (int j = 0; j < 16; j++) _mm512_storeu_ps(kt + (d0 + j) * GROUP, r[j]);
        }
#endif
    for (int l = 0; l < GROUP; l++)
        for (int64_t d = d0; d < dim; d++)
            kt[d * GROUP + l] = l < count ? (bf16 ? bf16_to_f32(((const uint16_t *)pool_keys)[rows[l] * dim + d])
                                                  : ((const float *)pool_keys)[rows[l] * dim + d])
                                          : 0.0f;
}

/* kt[d][l] = key d of pool row rows[l] of the table, widened to fp32, for l < count (<= GROUP);
 * 0 past it. A scaled table's rows are dequantized into a staging block first (up to
 * STAGED_DIM wide), then transposed as a plain table's. */
static void transpose_keys(const KeyTable *table, int bf16, const int64_t *rows, int count, int64_t dim,
                           float *restrict kt) {
    if (table->kind == PLAIN) {
        transpose_plain(table->values, bf16, rows, count, dim, kt);
        return;
    }
    if (dim <= STAGED_DIM) {
        union { /* the rows in the model dtype */
            float f32[GROUP * STAGED_DIM];
            uint16_t bf16[GROUP * STAGED_DIM];
        } staged;
        int64_t order[GROUP];
        for (int l = 0; l < count; l++) {
            scaled_row(table->values, rows[l] * dim, dim, table->scales[rows[l]], table->kind, bf16,
                       bf16 ? (void *)staged.bf16 : (void *)staged.f32, l * dim);
            order[l] = l;
        }
        transpose_plain(bf16 ? (const void *)staged.bf16 : (const void *)staged.f32, bf16, order, count, dim, kt);
        return;
    }
    float key[MAX_DIM];
    for (int l = 0; l < GROUP; l++) {
        if (l < count) read_keys(table, rows[l], dim, bf16, key);
        for (int64_t d = 0; d < dim; d++) kt[d * GROUP + l] = l < count ? key[d] : 0.0f;
    }
}

/* out[l] = sum_h w[h] * relu(scale * q[h] . key l) for the GROUP pools in kt [dim][GROUP]. */
static void score_group(const float *restrict kt, const float *restrict q, const float *restrict w, int heads,
                        int64_t dim, float scale, float *restrict out) {
    float sum[GROUP] = {0};
    for (int h = 0; h < heads; h++) {
        const float *qh = q + h * dim;
        float even[GROUP] = {0}, odd[GROUP] = {0}; /* two chains of multiply-adds, not one */
        int64_t d = 0;
        for (; d + 2 <= dim; d += 2)
            for (int l = 0; l < GROUP; l++) {
                even[l] += qh[d] * kt[d * GROUP + l];
                odd[l] += qh[d + 1] * kt[(d + 1) * GROUP + l];
            }
        for (; d < dim; d++)
            for (int l = 0; l < GROUP; l++) even[l] += qh[d] * kt[d * GROUP + l];
        for (int l = 0; l < GROUP; l++) {
            const float s = (even[l] + odd[l]) * scale;
            sum[l] += w[h] * (s > 0.0f ? s : 0.0f);
        }
    }
    for (int l = 0; l < GROUP; l++) out[l] = sum[l];
}

/* Ask for the keys of `pools` pool rows (`row_bytes` each) from pool row `table_row` on. */
static inline void prefetch_block(const char *pool_keys, int64_t table_row, int64_t pools, int64_t row_bytes) {
    const char *start = pool_keys + table_row * row_bytes;
    for (int64_t at = 0; at < pools * row_bytes; at += 64) __builtin_prefetch(start + at);
}

int dsa_index_scores(const void *q, const void *head_weights, int q_bf16, float weight_scale, const int64_t *pos,
                     int64_t kpool, const int64_t *request, const int64_t *block_tables, int64_t max_blocks,
                     int64_t pools_per_block, const void *pool_keys, const float *key_scales, int key_kind, int bf16,
                     int64_t tokens, int heads, int64_t dim, int64_t num_pools, float scale, float hidden, float *out,
                     int threads) {
    if (dim > MAX_DIM || heads > MAX_HEADS || heads * dim > MAX_QUERY || pools_per_block < 1) return -1;
    const int64_t chunks = (num_pools + POOL_CHUNK - 1) / POOL_CHUNK;
    const int64_t row_bytes = dim * (key_kind != PLAIN ? 1 : bf16 ? 2 : 4);
    const KeyTable keys = {(void *)pool_keys, (float *)key_scales, key_kind};
#pragma omp parallel for num_threads(threads) schedule(static, 1) if (tokens * chunks > 1)
    for (int64_t task = 0; task < tokens * chunks; task++) {
        const int64_t t = task % tokens, first = task / tokens * POOL_CHUNK;
        const int64_t end = first + POOL_CHUNK < num_pools ? first + POOL_CHUNK : num_pools;
        const int64_t *table = block_tables + request[t] * max_blocks;
        const int64_t visible = (pos[t] + 1) / kpool;
        float kt[MAX_DIM * GROUP], qt[MAX_QUERY], wt[MAX_HEADS], group[GROUP];
        int64_t rows[GROUP];
        widen_row(q, t * heads * dim, heads * dim, q_bf16, qt);
        widen_row(head_weights, t * heads, heads, q_bf16, wt);
        for (int h = 0; h < heads; h++) wt[h] *= weight_scale;
        float *row_out = out + t * num_pools;
        const int64_t seen = visible < first ? first : visible < end ? visible : end; /* this task's visible pools end */
        const int64_t last_block = seen > first ? (seen - 1) / pools_per_block : -1;
        int64_t block = first / pools_per_block; /* rows block by block: a division a pool cost about a head's dot */
        for (int64_t b = block; b < block + AHEAD_BLOCKS && b <= last_block; b++)
            prefetch_block(pool_keys, table[b] * pools_per_block, pools_per_block, row_bytes);
        int64_t row = 0, left_in_block = 0;
        if (first < seen) { /* (the first block is read from where the task starts in it) */
            row = table[block++] * pools_per_block + first % pools_per_block;
            left_in_block = pools_per_block - first % pools_per_block;
        }
        for (int64_t p0 = first; p0 < seen; p0 += GROUP) {
            const int count = seen - p0 < GROUP ? (int)(seen - p0) : GROUP;
            for (int l = 0; l < count; l++, row++, left_in_block--) {
                if (left_in_block == 0) {
                    if (block + AHEAD_BLOCKS - 1 <= last_block)
                        prefetch_block(pool_keys, table[block + AHEAD_BLOCKS - 1] * pools_per_block, pools_per_block,
                                       row_bytes);
                    row = table[block++] * pools_per_block;
                    left_in_block = pools_per_block;
                }
                rows[l] = row;
            }
            transpose_keys(&keys, bf16, rows, count, dim, kt);
            score_group(kt, qt, wt, heads, dim, scale, group);
            memcpy(row_out + p0, group, (size_t)count * sizeof(float));
        }
        for (int64_t p = seen; p < end; p++) row_out[p] = hidden;
    }
    return 0;
}

/* ---- the pools a query keeps ---------------------------------------------------------------
 *
 * chosen[t] = the k pools of row t of scores [tokens, n] with the highest scores, in ascending
 * pool order (as `select_every_pool` lists them when every pool is kept). Every NaN ranks
 * above +inf (as torch.topk ranks them) and -0 equals +0; among equal scores the lower pool
 * wins, so that the choice is a function of the scores alone (torch.topk's among ties is
 * whatever its selection algorithm leaves). `top_pools_torch` in kernels/dsa_index.py is the
 * same rule in torch.
 *
 * Radix selection on keys that order as the scores do, 8 bits a pass from the top: each pass
 * counts the members of the group still undecided by their next byte (after the first pass,
 * from a list of their pools: the row is read whole only to make keys, count and list once),
 * takes the groups above the one holding the k-th score whole, and stops once that group is
 * taken whole too; after the last byte the group is the scores equal to the k-th, taken
 * lowest pool first. */
static inline uint32_t order_key(float x) {
    uint32_t u; /* bit tests, not float compares: the same keys whatever the denormal mode */
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return UINT32_MAX; /* NaN, either sign */
    if ((u & 0x7fffffffu) == 0) u = 0;                      /* -0 -> +0 */
    return (u & 0x80000000u) ? ~u : u | 0x80000000u;
}

/* The k best of one row into out, in pool order; keys and candidates: n each of scratch. */
static void top_row(const float *row, int64_t n, int64_t k, int64_t *out, uint32_t *keys, int32_t *candidates) {
    if (k == 0) return;
    /* The first pass counts every key's top byte in four tables: consecutive keys of one
     * byte (scores of one magnitude) would otherwise wait on each other's increment. */
    int64_t counts[4][256] = {{0}};
    int64_t i = 0;
    for (; i < n; i++) keys[i] = order_key(row[i]);
    for (i = 0; i + 4 <= n; i += 4)
        for (int c = 0; c < 4; c++) counts[c][keys[i + c] >> 24]++;
    for (; i < n; i++) counts[0][keys[i] >> 24]++;
    uint32_t prefix = 0, mask = 0;
    int64_t wanted = k;  /* how many of the group (key & mask) == prefix to take, lowest pools first */
    int64_t members = n; /* the group's pools: all of them, then `candidates` */
    for (int shift = 24;; shift -= 8) {
        int64_t count[256] = {0};
        if (shift == 24) {
            for (int b = 0; b < 256; b++) count[b] = counts[0][b] + counts[1][b] + counts[2][b] + counts[3][b];
        } else {
            for (int64_t j = 0; j < members; j++) count[keys[candidates[j]] >> shift & 255]++;
        }
        int b = 255;
        for (; b > 0 && count[b] < wanted; b--) wanted -= count[b];
        prefix |= (uint32_t)b << shift;
        mask |= 255u << shift;
        if (count[b] == wanted || shift == 0) break; /* the group taken whole, or the k-th's equals */
        int64_t kept = 0; /* the group narrows to byte b: its pools, in pool order */
        if (shift == 24) {
            for (int64_t p = 0; p < n; p++)
                if ((keys[p] >> 24) == (uint32_t)b) candidates[kept++] = (int32_t)p;
        } else {
            for (int64_t j = 0; j < members; j++)
                if ((keys[candidates[j]] >> shift & 255) == (uint32_t)b) candidates[kept++] = candidates[j];
        }
        members = kept;
    }
    int64_t taken = 0, ties = 0;
    for (int64_t p = 0; p < n && taken < k; p++) {
        const uint32_t group = keys[p] & mask;
        if (group > prefix || (group == prefix && ties++ < wanted)) out[taken++] = p;
    }
}

/* The k best of one row whose pools at and past `visible` score -inf (hidden from its query):
 * all of them rank below every visible pool (an equal -inf, by the lower pool), so with k or
 * more visible pools the k best are among those, and with fewer they are the pools 0 .. k - 1.
 * A row's scores are sized by a power-of-two bound: at 16k tokens of context half of it is
 * hidden, and the selection's passes over it were 42-65 us a call in a batch-1 step. */
static void top_visible(const float *row, int64_t n, int64_t visible, int64_t k, int64_t *out, uint32_t *keys,
                        int32_t *candidates) {
    if (visible >= k) {
        top_row(row, visible < n ? visible : n, k, out, keys, candidates);
    } else {
        for (int64_t j = 0; j < k; j++) out[j] = j;
    }
}

/* k <= n < 2^31. With `pos` (else NULL), row t's pools at and past (pos[t] + 1) / kpool score
 * -inf (as dsa_index_scores writes them with hidden = -inf), and the selection skips them.
 * Rows are spread over threads where there is enough of them to pay for it. Returns 0, or -1
 * without scratch memory. */
int dsa_top_pools(const float *scores, int64_t tokens, int64_t n, int64_t k, const int64_t *pos, int64_t kpool,
                  int64_t *chosen, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) if (tokens > 1 && tokens * n >= 4096)
    {
        const size_t keys_bytes = (size_t)n * sizeof(uint32_t), candidates_bytes = (size_t)n * sizeof(int32_t);
        uint32_t *keys = NULL;
        int32_t *candidates = NULL;
        if (scratch_reserve(scratch_padded(keys_bytes) + scratch_padded(candidates_bytes)) == 0) {
            keys = scratch_take(keys_bytes);
            candidates = scratch_take(candidates_bytes);
        } else {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static) /* every thread meets it (its barrier), scratch or not */
        for (int64_t t = 0; t < tokens; t++) {
            if (keys == NULL) continue;
            if (pos != NULL)
                top_visible(scores + t * n, n, pos[t] < 0 ? 0 : (pos[t] + 1) / kpool, k, chosen + t * k, keys, candidates);
            else
                top_row(scores + t * n, n, k, chosen + t * k, keys, candidates);
        }
        scratch_done();
    }
    return failed ? -1 : 0;
}

/* The positions a query attends to, from the pools top-k chose (chosen [T, k], pool ids):
 *
 *   out[t][j P + o] = chosen[t][j] P + o     for o < P, or -1 where pool chosen[t][j] is not
 *                                            visible to query t (top-k filled up with it)
 *   then, with `tail`, P - 1 entries: visible[t] P + o for o < P - 1 where <= pos[t], else -1
 *
 * (`Indexer._select`'s torch form: about 15 eager ops.) out [T, k P + (tail ? P - 1 : 0)].
 * chosen NULL: every pool, chosen[t][j] = j (while top-k would keep them all); visible NULL:
 * each query's complete pools, (pos[t] + 1) / P. */
void dsa_expand_selection(const int64_t *chosen, int64_t tokens, int64_t k, const int64_t *visible, const int64_t *pos,
                          int64_t pool, int tail, int64_t *out) {
    const int64_t width = k * pool + (tail ? pool - 1 : 0);
    for (int64_t t = 0; t < tokens; t++) {
        int64_t *row = out + t * width;
        const int64_t seen = visible ? visible[t] : (pos[t] + 1) / pool;
        for (int64_t j = 0; j < k; j++) {
            const int64_t c = chosen ? chosen[t * k + j] : j;
            for (int64_t o = 0; o < pool; o++) row[j * pool + o] = c < seen ? c * pool + o : -1;
        }
        if (tail)
            for (int64_t o = 0; o < pool - 1; o++) {
                const int64_t p = seen * pool + o;
                row[k * pool + o] = p <= pos[t] ? p : -1;
            }
    }
}


/* One row's layer norm as torch computes it: fp32 moments (biased variance), then
 * (x - mean) * rstd * w + b. */
static void layer_norm_row(const float *x, const float *w, const float *b, float eps, int64_t dim, float *y) {
    float mean = 0.0f, var = 0.0f;
    for (int64_t d = 0; d < dim; d++) mean += x[d];
    mean /= (float)dim;
    for (int64_t d = 0; d < dim; d++) var += (x[d] - mean) * (x[d] - mean);
    const float rstd = 1.0f / sqrtf(var / (float)dim + eps);
    for (int64_t d = 0; d < dim; d++) y[d] = (x[d] - mean) * rstd * w[d] + b[d];
}

/* This step's indexer keys into the paged caches, then the compressed key of every pool the
 * step completes (read back from the tables: a pool's members include this step's tokens):
 *
 *   key_table[rows[t]]  = layer_norm(raw[t]; ln_w, ln_b)       gate_table[rows[t]] = gates[t]
 *   pool_table[pool_rows[n]][d] = sum_p softmax_p(gate[m_np][d] + ape[p][d]) * key[m_np][d]
 *
 * with m_np = member_rows[n][p]. Every tensor bf16 when `bf16`, else fp32; in bf16 the
 * probabilities and each product are rounded where `Indexer._write_keys`'s torch form rounds
 * them (about 14 eager ops a layer). The key and pool tables may be int8/fp8 (`key_kind`,
 * `pool_kind`, with their scales): keys are then read as dequantized to the model dtype and
 * stored quantized from it, as `ScaledRows` does. Returns -1 for a dim past the stack buffers,
 * -2 for a row outside its table (table_rows token rows, pool_table_rows pool rows), before
 * writing anything. */
int dsa_store_keys(const void *raw, const void *gates, const void *ln_w, const void *ln_b, float eps,
                   const int64_t *rows, int64_t tokens, int64_t dim, void *key_table, float *key_scales, int key_kind,
                   void *gate_table, int64_t table_rows, const int64_t *member_rows, const int64_t *pool_rows,
                   int64_t num_pools, int64_t pool, const void *ape, void *pool_table, float *pool_scales,
                   int pool_kind, int64_t pool_table_rows, int bf16) {
    if (dim > MAX_DIM) return -1;
    const KeyTable keys = {key_table, key_scales, key_kind}, pools = {pool_table, pool_scales, pool_kind};
    for (int64_t t = 0; t < tokens; t++)
        if (rows[t] < 0 || rows[t] >= table_rows) return -2;
    for (int64_t n = 0; n < num_pools; n++) {
        if (pool_rows[n] < 0 || pool_rows[n] >= pool_table_rows) return -2;
        for (int64_t p = 0; p < pool; p++)
            if (member_rows[n * pool + p] < 0 || member_rows[n * pool + p] >= table_rows) return -2;
    }
    float w[MAX_DIM], b[MAX_DIM], x[MAX_DIM], y[MAX_DIM];
    widen_row(ln_w, 0, dim, bf16, w);
    widen_row(ln_b, 0, dim, bf16, b);
    for (int64_t t = 0; t < tokens; t++) {
        widen_row(raw, t * dim, dim, bf16, x);
        layer_norm_row(x, w, b, eps, dim, y);
        write_keys(&keys, rows[t], dim, bf16, y);
        widen_row(gates, t * dim, dim, bf16, x);
        narrow_row(x, dim, bf16, gate_table, rows[t] * dim);
    }
    float gate[MAX_DIM], offset[MAX_DIM], key[MAX_DIM], top[MAX_DIM], total[MAX_DIM], sum[MAX_DIM];
    for (int64_t n = 0; n < num_pools; n++) {  /* softmax over the pool's tokens, each channel apart */
        const int64_t *members = member_rows + n * pool;
        for (int64_t d = 0; d < dim; d++) top[d] = -INFINITY, total[d] = 0.0f, sum[d] = 0.0f;
        for (int64_t p = 0; p < pool; p++) {
            widen_row(gate_table, members[p] * dim, dim, bf16, gate);
            widen_row(ape, p * dim, dim, bf16, offset);
            for (int64_t d = 0; d < dim; d++) top[d] = fmaxf(top[d], gate[d] + offset[d]);
        }
        for (int64_t p = 0; p < pool; p++) {
            widen_row(gate_table, members[p] * dim, dim, bf16, gate);
            widen_row(ape, p * dim, dim, bf16, offset);
            for (int64_t d = 0; d < dim; d++) total[d] += vexp(gate[d] + offset[d] - top[d]);
        }
        for (int64_t p = 0; p < pool; p++) {
            widen_row(gate_table, members[p] * dim, dim, bf16, gate);
            widen_row(ape, p * dim, dim, bf16, offset);
            read_keys(&keys, members[p], dim, bf16, key);
            for (int64_t d = 0; d < dim; d++) {
                const float prob = vexp(gate[d] + offset[d] - top[d]) / total[d];
                sum[d] += bf16 ? round_bf16(round_bf16(prob) * key[d]) : prob * key[d];
            }
        }
        write_keys(&pools, pool_rows[n], dim, bf16, sum);
    }
    return 0;
}
