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
 *
 * Each selected latent is read from the cache and widened once, into rows [n][C] (for the
 * weighted sum, vectorised over C), then transposed to [C][n] (for the scores, vectorised over
 * positions: each score sums its C products in order, with no per-score horizontal add).
 * bf16 latents of a multiple of 32 channels on AVX512-BF16 take bf16 pair products instead,
 * read from the cache as they are (`pair_attention`).
 *
 * An int8 or fp8 (e4m3) table (`kind`) holds one fp32 scale per row: each selected row is
 * dequantized as torch's `ScaledRows.gather` does it (value * scale in fp32, rounded to the
 * model dtype) into the thread's scratch, and attended to from there as from a table of the
 * model dtype: the bytes read from the cache are the table's own.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "scaled_rows.h"
#include "scratch.h"
#include "transpose16.h"
#include "vmath.h"


static inline float model_round(float x, int bf16) { return bf16 ? round_bf16(x) : x; }

/* dst [n][dim] (the model dtype) = rows[k] of the scaled table, dequantized; rows[k] <- k. */
static void dequantize_rows(const void *values, const float *scales, int kind, int64_t *rows, int64_t n, int64_t dim,
                            int bf16, void *dst) {
    for (int64_t k = 0; k < n; k++) {
        scaled_row(values, rows[k] * dim, dim, scales[rows[k]], kind, bf16, dst, k * dim);
        rows[k] = k;
    }
}

#define PREFETCH 8 /* latent rows read ahead */
#define PARTS 16     /* independent partial maxima and sums: the softmax's loops vectorise */

/* s[0..n) = round(softmax(round(s) * scale)): the maximum and the sum are taken as PARTS
 * partial ones, combined in lane order (a serial sum kept the exponentials scalar, the
 * larger part of a decode query's time). */
static void softmax(float *restrict s, int64_t n, float scale, int bf16) {
    float top_part[PARTS], sum_part[PARTS];
    for (int l = 0; l < PARTS; l++) top_part[l] = -INFINITY, sum_part[l] = 0.0f;
    const int64_t whole = n - n % PARTS;
    for (int64_t k = 0; k < n; k++) s[k] = model_round(s[k], bf16) * scale;
    for (int64_t k = 0; k < whole; k += PARTS)
        for (int l = 0; l < PARTS; l++) top_part[l] = s[k + l] > top_part[l] ? s[k + l] : top_part[l];
    float top = -INFINITY;
    for (int l = 0; l < PARTS; l++) top = top_part[l] > top ? top_part[l] : top;
    for (int64_t k = whole; k < n; k++) top = s[k] > top ? s[k] : top;
    for (int64_t k = 0; k < whole; k += PARTS)
        for (int l = 0; l < PARTS; l++) {
            s[k + l] = vexp(s[k + l] - top);
            sum_part[l] += s[k + l];
        }
    float total = 0.0f;
    for (int l = 0; l < PARTS; l++) total += sum_part[l];
    for (int64_t k = whole; k < n; k++) {
        s[k] = vexp(s[k] - top);
        total += s[k];
    }
    for (int64_t k = 0; k < n; k++) s[k] = model_round(s[k] / total, bf16);
}

/* Vectors of LANES floats: AVX-512 or AVX2 with FMA. Without either, the plain loops below
 * do everything (BLOCK_HEADS 0). */
#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
#define vec_zero _mm512_setzero_ps
#define vec_load _mm512_loadu_ps
#define vec_store _mm512_storeu_ps
#define vec_fmadd _mm512_fmadd_ps
#define vec_set1 _mm512_set1_ps
#define BLOCK_HEADS 4
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vec;
#define vec_zero _mm256_setzero_ps
#define vec_load _mm256_loadu_ps
#define vec_store _mm256_storeu_ps
#define vec_fmadd _mm256_fmadd_ps
#define vec_set1 _mm256_set1_ps
#define BLOCK_HEADS 4
#else
#define LANES 16
#define BLOCK_HEADS 0
#endif

#if BLOCK_HEADS
/* out[j][0..LANES) = sum_i a[j][i] * b[i][0..LANES) for 4 rows j at once (independent sums,
 * so the multiply-adds overlap), each summed in order of i: rows of a are `a_stride` apart,
 * rows of b `b_stride`, rows of out `out_stride`. Scores: a = 4 heads' queries, b = LANES
 * positions of the transposed latents; weighted sums: a = 4 heads' probabilities, b = LANES
 * channels of the latents. */
static inline void rows4_by_lanes(const float *a, int64_t a_stride, const float *b, int64_t b_stride, int64_t count,
                                  float *out, int64_t out_stride) {
    vec s0 = vec_zero(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t i = 0; i < count; i++) {
        const vec row = vec_load(b + i * b_stride);
        s0 = vec_fmadd(vec_set1(a[i]), row, s0);
        s1 = vec_fmadd(vec_set1(a[a_stride + i]), row, s1);
        s2 = vec_fmadd(vec_set1(a[2 * a_stride + i]), row, s2);
        s3 = vec_fmadd(vec_set1(a[3 * a_stride + i]), row, s3);
    }
    vec_store(out, s0);
    vec_store(out + out_stride, s1);
    vec_store(out + 2 * out_stride, s2);
    vec_store(out + 3 * out_stride, s3);
}

/* rows4_by_lanes for 2 x LANES columns: 8 sums in flight. Four kept each multiply-add waiting
 * on the one before it in its sum (4 cycles' latency, 2 units: half the units idle); the
 * same sums, in the same order. */
static inline void rows4_by_2lanes(const float *a, int64_t a_stride, const float *b, int64_t b_stride, int64_t count,
                                   float *out, int64_t out_stride) {
    vec s0 = vec_zero(), s1 = s0, s2 = s0, s3 = s0, t0 = s0, t1 = s0, t2 = s0, t3 = s0;
    for (int64_t i = 0; i < count; i++) {
        const vec row = vec_load(b + i * b_stride), next = vec_load(b + i * b_stride + LANES);
        const vec a0 = vec_set1(a[i]), a1 = vec_set1(a[a_stride + i]);
        const vec a2 = vec_set1(a[2 * a_stride + i]), a3 = vec_set1(a[3 * a_stride + i]);
        s0 = vec_fmadd(a0, row, s0);
        t0 = vec_fmadd(a0, next, t0);
        s1 = vec_fmadd(a1, row, s1);
        t1 = vec_fmadd(a1, next, t1);
        s2 = vec_fmadd(a2, row, s2);
        t2 = vec_fmadd(a2, next, t2);
        s3 = vec_fmadd(a3, row, s3);
        t3 = vec_fmadd(a3, next, t3);
    }
    const vec s[4] = {s0, s1, s2, s3}, t[4] = {t0, t1, t2, t3};
    for (int h = 0; h < 4; h++) {
        vec_store(out + h * out_stride, s[h]);
        vec_store(out + h * out_stride + LANES, t[h]);
    }
}
#endif

#if defined(__AVX512F__)
static inline void transpose_block(vec r[16]) { transpose16(r); }
#elif BLOCK_HEADS
/* The 8 x 8 block r[i][j] -> r[j][i]: pairs, then quads, then 128-bit halves. */
static inline void transpose_block(vec r[8]) {
    __m256 t[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
        t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
    }
    for (int i = 0; i < 8; i++) r[i] = t[i];
}
#endif

/* lat_t [C][n] = the transpose of lat [n][C]: LANES x LANES blocks in registers where the CPU
 * has vectors (the scalar copy cost as much as the scores it feeds), the edges one by one. */
static void transpose(const float *lat, int64_t n, int64_t dim, float *lat_t) {
    int64_t k0 = 0;
#if BLOCK_HEADS
    for (; k0 + LANES <= n; k0 += LANES)
        for (int64_t c0 = 0; c0 + LANES <= dim; c0 += LANES) {
            vec r[LANES];
            for (int i = 0; i < LANES; i++) r[i] = vec_load(lat + (k0 + i) * dim + c0);
            transpose_block(r);
            for (int i = 0; i < LANES; i++) vec_store(lat_t + (c0 + i) * n + k0, r[i]);
        }
    for (int64_t k = 0; k < k0; k++) /* the columns past the last whole block, of the whole blocks' rows */
        for (int64_t c = dim / LANES * LANES; c < dim; c++) lat_t[c * n + k] = lat[k * dim + c];
#endif
    for (int64_t k = k0; k < n; k++)
        for (int64_t c = 0; c < dim; c++) lat_t[c * n + k] = lat[k * dim + c];
}

/* out[h][j] = sum_i a[h][i] b[i][j], summed in order of i, for h < heads and j < cols: a
 * [heads][count], b [count][cols], out [heads][cols]. Scores: a = the queries, b = the
 * transposed latents [C][n]; weighted sums: a = the probabilities, b = the latents [n][C]. */
static void head_products(const float *a, int heads, int64_t count, const float *b, int64_t cols, float *out) {
    int h0 = 0;
#if BLOCK_HEADS
    for (; h0 + BLOCK_HEADS <= heads; h0 += BLOCK_HEADS) {
        int64_t j0 = 0;
        for (; j0 + 2 * LANES <= cols; j0 += 2 * LANES)
            rows4_by_2lanes(a + h0 * count, count, b + j0, cols, count, out + h0 * cols + j0, cols);
        for (; j0 + LANES <= cols; j0 += LANES)
            rows4_by_lanes(a + h0 * count, count, b + j0, cols, count, out + h0 * cols + j0, cols);
    }
#endif
    for (int h = 0; h < heads; h++)
        for (int64_t j = h < h0 ? cols / LANES * LANES : 0; j < cols; j++) {
            float sum = 0.0f;
            for (int64_t i = 0; i < count; i++) sum += a[h * count + i] * b[i * cols + j];
            out[h * cols + j] = sum;
        }
}

#if defined(__AVX512BF16__)
/* bf16 queries and latents whose width is a multiple of 32, on AVX512-BF16: each `vdpbf16ps`
 * multiplies 16 pairs of bf16 values and adds both products to 16 fp32 sums, so the products
 * take half the instructions of fp32 ones and nothing is widened or copied:
 *
 * - scores, 16 positions a block: their latents' 32-bit pairs (two channels) transposed in
 *   registers, so that vector j holds pair j of 16 positions; a head's 16 scores are then 16
 *   multiply-adds of its query's pair j, broadcast, into two sums (even and odd j).
 * - weighted sums, 2 positions a step: their latents' channels interleaved (unpack), so that
 *   each 32-bit lane holds one channel of both, against the two positions' probabilities
 *   (rounded to bf16 already, so exact as bf16) broadcast as a pair. The unpack leaves the
 *   channels of a 32-channel chunk in the order 0-3, 8-11, 16-19, 24-27 (low) and 4-7, ...
 *   (high), put back in order at the end.
 *
 * The sums are fp32 in another order than the fp32 path's, within the same tolerance. */
#define PAIR_HEADS 4 /* heads a pass: 4 x 2 chunks x 2 halves of sums in registers */

/* Scores of positions k0 .. k0 + count (count <= 16) for `hn` heads from h0 (a constant after
 * inlining): q [heads][dim] bf16, score [heads][n]. */
static inline __attribute__((always_inline)) void pair_scores(const uint16_t *q, int64_t h0, const int hn,
                                                              int64_t dim, const uint16_t *latent,
                                                              const int64_t *rows, int64_t k0, int count,
                                                              float *score, int64_t n) {
    __m512 even[PAIR_HEADS], odd[PAIR_HEADS];
    for (int h = 0; h < hn; h++) even[h] = odd[h] = _mm512_setzero_ps();
    for (int64_t d0 = 0; d0 < dim; d0 += 32) {
        __m512 r[16];
        for (int l = 0; l < 16; l++)
            r[l] = l < count ? _mm512_loadu_ps(latent + rows[k0 + l] * dim + d0) : _mm512_setzero_ps();
        transpose16(r);
        for (int j = 0; j < 16; j += 2)
            for (int h = 0; h < hn; h++) {
                const uint16_t *qh = q + (h0 + h) * dim + d0 + 2 * j; /* channel pairs j and j + 1 */
                uint32_t pair[2];
                memcpy(pair, qh, sizeof pair);
                even[h] = _mm512_dpbf16_ps(even[h], (__m512bh)_mm512_set1_epi32((int)pair[0]), (__m512bh)r[j]);
                odd[h] = _mm512_dpbf16_ps(odd[h], (__m512bh)_mm512_set1_epi32((int)pair[1]), (__m512bh)r[j + 1]);
            }
    }
    const __mmask16 keep = (__mmask16)((1u << count) - 1u);
    for (int h = 0; h < hn; h++) _mm512_mask_storeu_ps(score + (h0 + h) * n + k0, keep, _mm512_add_ps(even[h], odd[h]));
}

/* acc [heads][dim] = sum_k p[h][k] latent k for `hn` heads from h0 and `chunks` (1 or 2, a
 * constant after inlining) chunks of 32 channels from c0: p16 [heads][n_pad] bf16, n_pad even
 * with p16[h][n] = 0 where n is odd. */
static inline __attribute__((always_inline)) void pair_sums(const uint16_t *p16, int64_t n_pad, int64_t h0, const int hn,
                                                            int64_t c0, const int chunks, int64_t dim,
                                                            const uint16_t *latent, const int64_t *rows, int64_t n,
                                                            float *acc) {
    __m512 lo[PAIR_HEADS][2], hi[PAIR_HEADS][2];
    for (int h = 0; h < hn; h++)
        for (int c = 0; c < chunks; c++) lo[h][c] = hi[h][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; k += 2) {
        const uint16_t *a = latent + rows[k] * dim + c0, *b = k + 1 < n ? latent + rows[k + 1] * dim + c0 : NULL;
        __m512i low[2], high[2];
        for (int c = 0; c < chunks; c++) {
            const __m512i x = _mm512_loadu_si512(a + 32 * c), y = b ? _mm512_loadu_si512(b + 32 * c) : _mm512_setzero_si512();
            low[c] = _mm512_unpacklo_epi16(x, y);
            high[c] = _mm512_unpackhi_epi16(x, y);
        }
        for (int h = 0; h < hn; h++) {
            uint32_t pair;
            memcpy(&pair, p16 + (h0 + h) * n_pad + k, sizeof pair);
            const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int c = 0; c < chunks; c++) {
                lo[h][c] = _mm512_dpbf16_ps(lo[h][c], p, (__m512bh)low[c]);
                hi[h][c] = _mm512_dpbf16_ps(hi[h][c], p, (__m512bh)high[c]);
            }
        }
    }
    /* channels in order: 128-bit lanes of low and high alternate */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int h = 0; h < hn; h++)
        for (int c = 0; c < chunks; c++) {
            float *out = acc + (h0 + h) * dim + c0 + 32 * c;
            _mm512_storeu_ps(out, _mm512_permutex2var_ps(lo[h][c], first, hi[h][c]));
            _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(lo[h][c], second, hi[h][c]));
        }
}

/* One query on the bf16 pairs path: q [heads][dim], scratch score [heads][n] and p16
 * [heads][n + 1] (bf16), acc [heads][dim] fp32. */
static void pair_attention(const uint16_t *q, int heads, int64_t dim, const uint16_t *latent, const int64_t *rows,
                           int64_t n, float scale, float *score, uint16_t *p16, float *acc) {
    for (int64_t k0 = 0; k0 < n; k0 += 16) {
        const int count = n - k0 < 16 ? (int)(n - k0) : 16;
        for (int h0 = 0; h0 < heads; h0 += PAIR_HEADS) {
            switch (heads - h0 < PAIR_HEADS ? heads - h0 : PAIR_HEADS) { /* a constant head count per case */
            case 1: pair_scores(q, h0, 1, dim, latent, rows, k0, count, score, n); break;
            case 2: pair_scores(q, h0, 2, dim, latent, rows, k0, count, score, n); break;
            case 3: pair_scores(q, h0, 3, dim, latent, rows, k0, count, score, n); break;
            default: pair_scores(q, h0, 4, dim, latent, rows, k0, count, score, n); break;
            }
        }
    }
    const int64_t n_pad = n + (n & 1);
    for (int h = 0; h < heads; h++) {
        softmax(score + h * n, n, scale, 1);
        for (int64_t k = 0; k < n; k++) p16[h * n_pad + k] = f32_to_bf16(score[h * n + k]);
        if (n & 1) p16[h * n_pad + n] = 0;
    }
    for (int h0 = 0; h0 < heads; h0 += PAIR_HEADS) {
        const int hn = heads - h0 < PAIR_HEADS ? heads - h0 : PAIR_HEADS;
        for (int64_t c0 = 0; c0 < dim; c0 += 64) {
            const int chunks = dim - c0 >= 64 ? 2 : 1;
            switch (hn * 2 + chunks - 1) { /* constants per case: the sums stay in registers */
            case 2: pair_sums(p16, n_pad, h0, 1, c0, 1, dim, latent, rows, n, acc); break;
            case 3: pair_sums(p16, n_pad, h0, 1, c0, 2, dim, latent, rows, n, acc); break;
            case 4: pair_sums(p16, n_pad, h0, 2, c0, 1, dim, latent, rows, n, acc); break;
            case 5: pair_sums(p16, n_pad, h0, 2, c0, 2, dim, latent, rows, n, acc); break;
            case 6: pair_sums(p16, n_pad, h0, 3, c0, 1, dim, latent, rows, n, acc); break;
            case 7: pair_sums(p16, n_pad, h0, 3, c0, 2, dim, latent, rows, n, acc); break;
            case 8: pair_sums(p16, n_pad, h0, 4, c0, 1, dim, latent, rows, n, acc); break;
            default: pair_sums(p16, n_pad, h0, 4, c0, 2, dim, latent, rows, n, acc); break;
            }
        }
    }
}
#endif

int mla_latent_attention(const void *q, const void *cache, const float *scales, int kind, const int64_t *positions,
                         int64_t width, const int64_t *request, const int64_t *block_tables, int64_t max_blocks,
                         int64_t block_size, int64_t tokens, int heads, int64_t dim, float scale, int bf16, void *out,
                         int threads) {
    if (threads < 1) threads = 1;
    const int64_t k_room = width > 0 ? width : 1;
    /* per thread: the query's heads [H][C], sums [H][C], scores [H][K], latents [K][C] and [C][K],
     * bf16 probabilities [H][K + 1] (the pairs path's), and a scaled table's rows dequantized [K][C] */
    const int64_t dequantized = kind == PLAIN ? 0 : k_room * dim;
    const int64_t per_thread =
        2 * heads * dim + heads * k_room + 2 * k_room * dim + (heads * (k_room + 1) + 1) / 2 + dequantized;
    const size_t scratch_bytes = (size_t)(threads * per_thread) * sizeof(float);
    const size_t rows_bytes = (size_t)(threads * k_room) * sizeof(int64_t);
    if (scratch_reserve(scratch_padded(scratch_bytes) + scratch_padded(rows_bytes)) != 0) return -2;
    float *scratch = scratch_take(scratch_bytes);
    int64_t *rows_all = scratch_take(rows_bytes);
    int block_shift = -1;
    for (int s = 0; s < 62; s++)
        if ((INT64_C(1) << s) == block_size) block_shift = s;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens > 1)
    for (int64_t t = 0; t < tokens; t++) {
        const int id = omp_get_thread_num();
        float *qf = scratch + id * per_thread, *acc = qf + heads * dim, *score = acc + heads * dim;
        float *lat = score + heads * k_room, *lat_t = lat + k_room * dim;
        uint16_t *p16 = (uint16_t *)(lat_t + k_room * dim);
        float *own = qf + per_thread - dequantized; /* (a scaled table's rows) */
        int64_t *rows = rows_all + id * k_room;
        const int64_t *pos = positions + t * width, *table = block_tables + request[t] * max_blocks;
        int64_t n = 0;
        if (block_shift >= 0) { /* a power of two: a shift and a mask (a division cost ~20% of a decode query) */
            for (int64_t k = 0; k < width; k++)
                if (pos[k] >= 0) rows[n++] = (table[pos[k] >> block_shift] << block_shift) | (pos[k] & (block_size - 1));
        } else {
            for (int64_t k = 0; k < width; k++)
                if (pos[k] >= 0) rows[n++] = table[pos[k] / block_size] * block_size + pos[k] % block_size;
        }
        const void *latent = cache;
        if (kind != PLAIN) {
            dequantize_rows(cache, scales, kind, rows, n, dim, bf16, own);
            latent = own;
        }
#if defined(__AVX512BF16__)
        if (bf16 && dim % 32 == 0) {
            pair_attention((const uint16_t *)q + t * heads * dim, heads, dim, latent, rows, n, scale, score, p16, acc);
            uint16_t *o = (uint16_t *)out + t * heads * dim;
            for (int64_t i = 0; i < heads * dim; i++) o[i] = f32_to_bf16(acc[i]);
            continue;
        }
#endif
        widen_row(q, t * heads * dim, heads * dim, bf16, qf);
        const int64_t row_bytes = dim * (bf16 ? 2 : 4);
        for (int64_t k = 0; k < n; k++) {
            if (k + PREFETCH < n) /* the rows are scattered over the cache's blocks: ask for them early */
                for (int64_t at = 0; at < row_bytes; at += 64)
                    __builtin_prefetch((const char *)latent + rows[k + PREFETCH] * row_bytes + at);
            widen_row(latent, rows[k] * dim, dim, bf16, lat + k * dim);
        }
        transpose(lat, n, dim, lat_t);
        head_products(qf, heads, dim, lat_t, n, score); /* score[h][k] = q[h] . latent k */
        for (int h = 0; h < heads; h++) softmax(score + h * n, n, scale, bf16);
        head_products(score, heads, n, lat, dim, acc); /* acc[h] = sum_k p[h][k] latent k */
        const int64_t at = t * heads * dim;
        if (bf16) {
            uint16_t *o = (uint16_t *)out + at;
            for (int64_t i = 0; i < heads * dim; i++) o[i] = f32_to_bf16(acc[i]);
        } else {
            memcpy((float *)out + at, acc, (size_t)(heads * dim) * sizeof(float));
        }
    }
    scratch_done();
    return 0;
}
