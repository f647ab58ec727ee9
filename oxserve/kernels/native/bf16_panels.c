/* Routed experts and plain products in bf16 on weights packed once at load into panels, for
 * any number of rows per expert, on AMX tiles or, on CPUs without AMX, AVX512-BF16 vectors,
 * or, without either, AVX2 vectors that widen bf16 to fp32.
 *
 * The same products and roundings as moe_bf16.c (see there), on weights packed once at load
 * into the pair-interleaved ("VNNI") panels that an AMX B tile reads in one load:
 *
 *     W [N, K] -> packed [N/16][K/2][16][2]:  packed[b][p][n][t] = W[16 b + n][2 p + t]
 *
 * so the 16 output channels of a panel and 32 of its inputs are one contiguous 1 KiB tile,
 * and one input pair of the 16 channels is one 64-byte vector for `vdpbf16ps`.
 * gate_up [E, 2I, H] and down [E, H, I] are packed per expert (N = 2I, K = H; N = H, K = I).
 *
 * Why: torch's grouped GEMM pays a oneDNN set-up per expert and call, and the dot-product
 * kernel of moe_bf16.c runs out of arithmetic past a few rows per expert; here each loaded
 * weight vector serves every row of the block (a tile multiply does 16 x 16 x 32
 * multiply-adds per instruction; a vector one 16 x 2 per row), so the experts cost about what
 * reading their weights costs at decode batch sizes.
 *
 * Built for each instruction set (oxserve/kernels/moe.py): with -mamx-tile -mamx-bf16 the
 * panel products run on tiles (__AMX_TILE__); without, on AVX512-BF16 vectors; on CPUs with
 * neither (AVX2 + FMA only), each weight vector is widened to fp32 (a bf16 value is the top
 * half of its fp32) and multiplied-added in input order: bf16 products are exact in fp32, so
 * every output is the sequential fp32 sum that torch's bf16 `F.linear` computes there. The
 * first two sum each output's products in input order in fp32 too, so they agree with each
 * other and with oneDNN's bf16 products; the AVX2 build differs from them in the rounding of
 * a pair's two products (summed one at a time, not together)
 *
 * Tiles: 0 and 1 accumulate (up to 16 rows x 16 fp32), 2 holds rows of x or of the
 * activations (16 x 32 bf16), 3 and 4 weight panels. Each OpenMP thread configures its own
 * tiles (the configuration is per thread) with the row count of its current chunk. */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bf16.h"
#include "pairs.h"
#include "scratch.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TILE_M 16  /* rows per tile */
#define TILE_N 16  /* output channels per panel */
#define TILE_K 32  /* bf16 inputs per tile row */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

#ifdef __AMX_TILE__
/* Ask Linux for the tile data state (once per process); 0 when granted. */
int panels_enable(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1; }

/* Configure this thread's tiles for m rows, unless they already are. */
static void rows_of_block(int m, int *configured) {
    if (m == *configured) return;
    TileConfig c = {0};
    c.palette = 1;
    for (int t = 0; t < 3; t++) { c.rows[t] = (uint8_t)m; c.colsb[t] = 64; }
    for (int t = 3; t < 5; t++) { c.rows[t] = TILE_K / 2; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
    *configured = m;
}

static void release_tiles(int configured) {
    if (configured) _tile_release();
}
#else
int panels_enable(void) { return 0; } /* vectors need no permission */
static void rows_of_block(int m, int *configured) { *configured = m; }
static void release_tiles(int configured) { (void)configured; }
#endif

/* e^x = 2^n e^r, n = round(x / ln2), r = x - n ln2 (ln2 in two parts), e^r by Cephes' degree-7
 * polynomial: the coefficients both vector widths below use. */
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

#if defined(__AMX_TILE__) || defined(__AVX512BF16__)
/* e^x on 16 lanes: x = n ln2 + r, |r| <= ln2/2, e^r by Cephes' degree-7 polynomial, times 2^n
 * (scalef saturates to inf and 0). Within 2 ulp of expf; its bf16 rounding rarely differs. */
static inline __m512 exp16(__m512 x) {
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* fp32 -> bf16 (nearest even, NaN kept) -> fp32 on 16 lanes */
static inline __m512 round16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* One row of 16 intermediate channels: bf16(bf16(bf16(silu(min(g, limit))) * clamp(u)) * w),
 * rounded where moe_bf16.c rounds. min/max take the NaN from their second operand. */
static inline void glu16(const float *gate, const float *up, float limit, float w, uint16_t *out) {
    __m512 lim = _mm512_set1_ps(limit);
    __m512 g = _mm512_min_ps(lim, round16(_mm512_loadu_ps(gate)));
    __m512 u = _mm512_max_ps(_mm512_set1_ps(-limit), _mm512_min_ps(lim, round16(_mm512_loadu_ps(up))));
    __m512 silu = round16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
    __m512 act = _mm512_mul_ps(round16(_mm512_mul_ps(silu, u)), _mm512_set1_ps(w));
    _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(act));
}

/* 16 fp32 sums -> bf16 (nearest even) */
static inline void store_bf16x16(const float *sums, uint16_t *out) {
    _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sums)));
}

/* The first `valid` of 16 fp32 sums, rounded to bf16, stored as bf16 or (f32_out) as fp32. */
static inline void store_rounded(const float *sums, int64_t valid, void *y, int64_t at, int f32_out) {
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sums));
    const __mmask16 keep = (__mmask16)((1u << valid) - 1u);
    if (f32_out)
        _mm512_mask_storeu_ps((float *)y + at, keep, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded), 16)));
    else
        _mm256_mask_storeu_epi16((uint16_t *)y + at, keep, rounded);
}
#else
/* The same helpers on 8-lane AVX2 vectors, two per 16 channels. */
static inline __m256 widen8(__m256i bf16_in_low_halves) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_in_low_halves, 16));
}

/* fp32 -> bf16 bits in each lane's low half: nearest even, a NaN kept a (quiet) NaN, as f32_to_bf16 */
static inline __m256i bf16_bits8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    const __m256i quiet = _mm256_srli_epi32(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)), 16);
    return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

static inline __m256 round8(__m256 v) { return widen8(bf16_bits8(v)); }

/* e^x on 8 lanes as exp16 does, with 2^n made in two normal factors (so results that are
 * subnormal, 0 or inf come out as scalef gives them) and x first held where they do. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(89.0f), _mm256_max_ps(_mm256_set1_ps(-104.0f), x)); /* a NaN passes */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1); /* n = half + (n - half), each in [-75, 65] */
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s0), s1);
}

static inline void glu16(const float *gate, const float *up, float limit, float w, uint16_t *out) {
    const __m256 lim = _mm256_set1_ps(limit);
    __m256i bits[2];
    for (int h = 0; h < 2; h++) {
        __m256 g = _mm256_min_ps(lim, round8(_mm256_loadu_ps(gate + 8 * h)));
        __m256 u = _mm256_max_ps(_mm256_set1_ps(-limit), _mm256_min_ps(lim, round8(_mm256_loadu_ps(up + 8 * h))));
        __m256 silu = round8(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)))));
        bits[h] = bf16_bits8(_mm256_mul_ps(round8(_mm256_mul_ps(silu, u)), _mm256_set1_ps(w)));
    }
    /* packus interleaves 128-bit halves: [lo 0-3, hi 0-3, lo 4-7, hi 4-7] -> in order */
    _mm256_storeu_si256((__m256i *)out, _mm256_permute4x64_epi64(_mm256_packus_epi32(bits[0], bits[1]), 0xd8));
}

static inline void store_bf16x16(const float *sums, uint16_t *out) {
    const __m256i packed = _mm256_packus_epi32(bf16_bits8(_mm256_loadu_ps(sums)), bf16_bits8(_mm256_loadu_ps(sums + 8)));
    _mm256_storeu_si256((__m256i *)out, _mm256_permute4x64_epi64(packed, 0xd8));
}

static inline void store_rounded(const float *sums, int64_t valid, void *y, int64_t at, int f32_out) {
    uint16_t rounded[TILE_N];
    store_bf16x16(sums, rounded);
    if (f32_out)
        for (int64_t c = 0; c < valid; c++) ((float *)y)[at + c] = bf16_to_f32(rounded[c]);
    else
        memcpy((uint16_t *)y + at, rounded, (size_t)valid * sizeof(uint16_t));
}
#endif

static inline int64_t start_of(const int32_t *offsets, int64_t e) { return e == 0 ? 0 : offsets[e - 1]; }
static inline int64_t rows_of(const int32_t *offsets, int64_t e) { return offsets[e] - start_of(offsets, e); }

/* The experts that have rows, most rows first (equal counts in expert order), into order;
 * returns how many. Tasks are handed out in this order: the last ones are the smallest, so
 * threads finish together, and an expert without rows costs no task at all (a decode step
 * of a model with hundreds of experts reaches few). A counting sort: slots holds P + 1. */
static int64_t busiest_first(const int32_t *offsets, int64_t E, int64_t P, int64_t *order, int64_t *slots) {
    memset(slots, 0, (size_t)(P + 1) * sizeof(int64_t));
    for (int64_t e = 0; e < E; e++) /* key P - rows: 0 for the busiest possible */
        if (rows_of(offsets, e) > 0) slots[P - rows_of(offsets, e) + 1]++;
    for (int64_t k = 1; k <= P; k++) slots[k] += slots[k - 1]; /* slots[key]: where that key's experts start */
    for (int64_t e = 0; e < E; e++)
        if (rows_of(offsets, e) > 0) order[slots[P - rows_of(offsets, e)]++] = e;
    return slots[P - 1];
}

/* Panel b of expert e in `packed` (per expert: N/16 panels of K/2 x 16 x 2). */
static inline const uint16_t *panel(const uint16_t *packed, int64_t n, int64_t k, int64_t e, int64_t b) {
    return packed + (e * (n / TILE_N) + b) * (k / 2) * (2 * TILE_N);
}

/* The two panels of a task to come (w0 NULL: none), of the same k inputs, fetched towards
 * L2 one line each per input pair while this task's products run. At decode sizes a task's
 * few rows against its panels (16 KiB at k = 256) cost about what fetching them does; asked
 * for in one burst before the task, the 256 prefetches filled the core's misses in flight
 * and the loads behind them waited, so fetches and arithmetic took turns (python
 * docs/bench/call_times.py 32: routed experts 109-138 -> 84-90 us a call in the step). */
typedef struct {
    const uint16_t *w0, *w1;
} Ahead;

static const Ahead NOTHING_AHEAD = {NULL, NULL};

/* acc0, acc1 [m, 16] fp32 = a [m, k] (rows `lda` apart) times two weight panels, from their
 * first tiles w0 and w1 (a panel's tiles follow each other, 1 KiB apart), fetching `ahead`
 * meanwhile. m <= 16; on AMX the tiles must be configured for m rows. */
#ifdef __AMX_TILE__
static void panel_pair(const uint16_t *a, int64_t lda, int64_t k, const uint16_t *w0, const uint16_t *w1, int m,
                       float *acc0, float *acc1, Ahead ahead) {
    (void)m;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t kk = 0; kk < k / TILE_K; kk++) {
        if (ahead.w0 != NULL) /* the next panels' tiles kk: 1 KiB each, 16 lines */
            for (int64_t at = 0; at < TILE_K * TILE_N; at += 32) {
                __builtin_prefetch(ahead.w0 + kk * TILE_K * TILE_N + at, 0, 2);
                __builtin_prefetch(ahead.w1 + kk * TILE_K * TILE_N + at, 0, 2);
            }
        _tile_loadd(2, a + kk * TILE_K, lda * 2);
        _tile_loadd(3, w0 + kk * TILE_K * TILE_N, 64);
        _tile_loadd(4, w1 + kk * TILE_K * TILE_N, 64);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, acc0, 64);
    _tile_stored(1, acc1, 64);
}
#elif defined(__AVX512BF16__)
#define VEC_ROWS 8 /* rows per pass: 16 accumulators, two weight vectors and a broadcast fit the 32 registers */

/* `rows` (a constant after inlining) rows of a against both panels: each weight vector,
 * one input pair of 16 channels, is loaded once and used for every row. */
static inline __attribute__((always_inline)) void vector_rows(const uint16_t *a, int64_t lda, int64_t k,
                                                              const uint16_t *w0, const uint16_t *w1, const int rows,
                                                              float *acc0, float *acc1, Ahead ahead) {
    __m512 c0[VEC_ROWS], c1[VEC_ROWS];
    for (int r = 0; r < rows; r++) c0[r] = c1[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < k / 2; p++) {
        if (ahead.w0 != NULL) { /* a pair of inputs of 16 channels: one line of each panel */
            __builtin_prefetch(ahead.w0 + p * 2 * TILE_N, 0, 2);
            __builtin_prefetch(ahead.w1 + p * 2 * TILE_N, 0, 2);
        }
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + p * 2 * TILE_N);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(w1 + p * 2 * TILE_N);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, a + r * lda + 2 * p, sizeof pair);
            const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
            c0[r] = _mm512_dpbf16_ps(c0[r], x, b0);
            c1[r] = _mm512_dpbf16_ps(c1[r], x, b1);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(acc0 + r * TILE_N, c0[r]);
        _mm512_storeu_ps(acc1 + r * TILE_N, c1[r]);
    }
}

static void panel_pair(const uint16_t *a, int64_t lda, int64_t k, const uint16_t *w0, const uint16_t *w1, int m,
                       float *acc0, float *acc1, Ahead ahead) {
    for (int r0 = 0; r0 < m; r0 += VEC_ROWS) {
        const uint16_t *ar = a + r0 * lda;
        float *o0 = acc0 + r0 * TILE_N, *o1 = acc1 + r0 * TILE_N;
        const Ahead fetch = r0 == 0 ? ahead : NOTHING_AHEAD; /* in the first pass over the panels */
        switch (m - r0 < VEC_ROWS ? m - r0 : VEC_ROWS) { /* a constant row count per case: registers, not memory */
        case 1: vector_rows(ar, lda, k, w0, w1, 1, o0, o1, fetch); break;
        case 2: vector_rows(ar, lda, k, w0, w1, 2, o0, o1, fetch); break;
        case 3: vector_rows(ar, lda, k, w0, w1, 3, o0, o1, fetch); break;
        case 4: vector_rows(ar, lda, k, w0, w1, 4, o0, o1, fetch); break;
        case 5: vector_rows(ar, lda, k, w0, w1, 5, o0, o1, fetch); break;
        case 6: vector_rows(ar, lda, k, w0, w1, 6, o0, o1, fetch); break;
        case 7: vector_rows(ar, lda, k, w0, w1, 7, o0, o1, fetch); break;
        default: vector_rows(ar, lda, k, w0, w1, 8, o0, o1, fetch); break;
        }
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define VEC_ROWS 4   /* rows per pass: 8 accumulators, four widened weight vectors, two broadcasts */
#define X_CHUNK 512  /* inputs of a row block widened at a time (4 x 512 fp32: 8 KiB of stack) */

/* `rows` (a constant after inlining) rows of x, already fp32 (X_CHUNK apart), against `pairs`
 * input pairs of one panel, channels 0-7 and 8-15 in two registers per row. A weight pair
 * vector (8 channels x 2 inputs) splits into its even inputs (shifted up) and odd ones
 * (masked), each loaded and widened once for every row; a row's input is one broadcast load. */
static inline __attribute__((always_inline)) void widened_rows(const float *x, int64_t pairs, const uint16_t *w,
                                                               const int rows, float *acc, const uint16_t *fetch) {
    const __m256i odd = _mm256_set1_epi32((int)0xffff0000u);
    __m256 lo[VEC_ROWS], hi[VEC_ROWS];
    for (int r = 0; r < rows; r++) {
        lo[r] = _mm256_loadu_ps(acc + r * TILE_N);
        hi[r] = _mm256_loadu_ps(acc + r * TILE_N + 8);
    }
    for (int64_t p = 0; p < pairs; p++) {
        if (fetch != NULL) __builtin_prefetch(fetch + p * 2 * TILE_N, 0, 2); /* the same line of a panel to come */
        const __m256i w_lo = _mm256_loadu_si256((const __m256i *)(w + p * 2 * TILE_N));
        const __m256i w_hi = _mm256_loadu_si256((const __m256i *)(w + p * 2 * TILE_N + TILE_N));
        const __m256 even_lo = widen8(w_lo), odd_lo = _mm256_castsi256_ps(_mm256_and_si256(w_lo, odd));
        const __m256 even_hi = widen8(w_hi), odd_hi = _mm256_castsi256_ps(_mm256_and_si256(w_hi, odd));
        for (int r = 0; r < rows; r++) {
            const __m256 x_even = _mm256_broadcast_ss(x + r * X_CHUNK + 2 * p);
            const __m256 x_odd = _mm256_broadcast_ss(x + r * X_CHUNK + 2 * p + 1);
            lo[r] = _mm256_fmadd_ps(x_odd, odd_lo, _mm256_fmadd_ps(x_even, even_lo, lo[r]));
            hi[r] = _mm256_fmadd_ps(x_odd, odd_hi, _mm256_fmadd_ps(x_even, even_hi, hi[r]));
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(acc + r * TILE_N, lo[r]);
        _mm256_storeu_ps(acc + r * TILE_N + 8, hi[r]);
    }
}

/* A block of rows runs over the inputs X_CHUNK at a time: the chunk's rows widened once (for
 * both panels), each panel's sums carried from chunk to chunk in acc, so every output is
 * still summed in input order. */
static void panel_pair(const uint16_t *a, int64_t lda, int64_t k, const uint16_t *w0, const uint16_t *w1, int m,
                       float *acc0, float *acc1, Ahead ahead) {
    float x[VEC_ROWS * X_CHUNK];
    memset(acc0, 0, (size_t)m * TILE_N * sizeof(float));
    memset(acc1, 0, (size_t)m * TILE_N * sizeof(float));
    for (int r0 = 0; r0 < m; r0 += VEC_ROWS) {
        const int rows = m - r0 < VEC_ROWS ? m - r0 : VEC_ROWS;
        for (int64_t k0 = 0; k0 < k; k0 += X_CHUNK) {
            const int64_t n = k - k0 < X_CHUNK ? k - k0 : X_CHUNK;
            for (int r = 0; r < rows; r++) widen_row(a + (r0 + r) * lda, k0, n, 1, x + r * X_CHUNK);
            for (int half = 0; half < 2; half++) {
                const uint16_t *w = (half ? w1 : w0) + k0 * TILE_N; /* a pair of inputs is 2 x 16 weights */
                const uint16_t *next = half ? ahead.w1 : ahead.w0;
                const uint16_t *fetch = r0 == 0 && next != NULL ? next + k0 * TILE_N : NULL;
                float *out = (half ? acc1 : acc0) + r0 * TILE_N;
                switch (rows) { /* a constant row count per case */
                case 1: widened_rows(x, n / 2, w, 1, out, fetch); break;
                case 2: widened_rows(x, n / 2, w, 2, out, fetch); break;
                case 3: widened_rows(x, n / 2, w, 3, out, fetch); break;
                default: widened_rows(x, n / 2, w, 4, out, fetch); break;
                }
            }
        }
    }
}
#else
#error "bf16_panels.c needs AMX-BF16 (-mamx-tile -mamx-bf16), AVX512-BF16, or AVX2 with FMA"
#endif

/* The scratch of experts_products: act [P, I] bf16, order [E], slots [P + 1]. */
typedef struct {
    uint16_t *act;
    int64_t *order, *slots;
} ExpertsScratch;

static size_t experts_scratch_bytes(int64_t P, int64_t E, int64_t I) {
    return scratch_padded((size_t)(P * I) * sizeof(uint16_t)) + scratch_padded((size_t)E * sizeof(int64_t)) +
           scratch_padded((size_t)(P + 1) * sizeof(int64_t));
}

static ExpertsScratch take_experts_scratch(int64_t P, int64_t E, int64_t I) {
    ExpertsScratch s;
    s.act = scratch_take((size_t)(P * I) * sizeof(uint16_t));
    s.order = scratch_take((size_t)E * sizeof(int64_t));
    s.slots = scratch_take((size_t)(P + 1) * sizeof(int64_t));
    return s;
}

/* panels_experts on scratch taken by its caller. */
static void experts_products(const uint16_t *x, int64_t P, int64_t H, const int32_t *offsets, int64_t E,
                             const float *row_weight, const uint16_t *gate_up, const uint16_t *down, int64_t I,
                             float limit, uint16_t *y, int nthreads, ExpertsScratch s) {
    if (P == 0) return;
    uint16_t *act = s.act;
    const int64_t *order = s.order;
    const int64_t panels_i = I / TILE_N, pairs_h = H / (2 * TILE_N), busy = busiest_first(offsets, E, P, s.order, s.slots);
    /* Where every thread count divides an expert's tasks, round-robin gives each thread the
     * same share of every expert, however uneven the experts: then a thread knows its next
     * tasks and fetches the panels of its task after next while it computes (at decode sizes
     * a few rows against 64 x H bytes of weights, 16 KiB at H = 256, that come from memory,
     * not cache). Elsewhere tasks come from a queue, busiest expert first. */
    const int even = nthreads > 0 && panels_i % nthreads == 0 && pairs_h % nthreads == 0;
    omp_set_schedule(even ? omp_sched_static : omp_sched_dynamic, 1);
    #pragma omp parallel num_threads(nthreads)
    {
        int configured = 0;
        float acc0[TILE_M * TILE_N], acc1[TILE_M * TILE_N];
        const int64_t stride = even ? 2 * (int64_t)omp_get_num_threads() : 0; /* 0: no prefetch */
        /* gate and up for 16 intermediate channels of one expert, 16 rows at a time */
        #pragma omp for schedule(runtime)
        for (int64_t task = 0; task < busy * panels_i; task++) {
            int64_t e = order[task / panels_i], b = task % panels_i;
            Ahead ahead = NOTHING_AHEAD;
            if (stride && task + stride < busy * panels_i) {
                const int64_t ne = order[(task + stride) / panels_i], nb = (task + stride) % panels_i;
                ahead = (Ahead){panel(gate_up, 2 * I, H, ne, nb), panel(gate_up, 2 * I, H, ne, panels_i + nb)};
            }
            for (int64_t m0 = start_of(offsets, e), end = offsets[e]; m0 < end; m0 += TILE_M) {
                int m = end - m0 < TILE_M ? (int)(end - m0) : TILE_M;
                rows_of_block(m, &configured);
                panel_pair(x + m0 * H, H, H, panel(gate_up, 2 * I, H, e, b), panel(gate_up, 2 * I, H, e, panels_i + b),
                           m, acc0, acc1, m0 == start_of(offsets, e) ? ahead : NOTHING_AHEAD);
                for (int r = 0; r < m; r++)
                    glu16(acc0 + r * TILE_N, acc1 + r * TILE_N, limit, row_weight[m0 + r], act + (m0 + r) * I + b * TILE_N);
            }
        }
        /* the implicit barrier: every act row is complete before the down products read it */
        #pragma omp for schedule(runtime)
        for (int64_t task = 0; task < busy * pairs_h; task++) {
            int64_t e = order[task / pairs_h], b = 2 * (task % pairs_h);
            Ahead ahead = NOTHING_AHEAD;
            if (stride && task + stride < busy * pairs_h) {
                const int64_t ne = order[(task + stride) / pairs_h], nb = 2 * ((task + stride) % pairs_h);
                ahead = (Ahead){panel(down, H, I, ne, nb), panel(down, H, I, ne, nb + 1)};
            }
            for (int64_t m0 = start_of(offsets, e), end = offsets[e]; m0 < end; m0 += TILE_M) {
                int m = end - m0 < TILE_M ? (int)(end - m0) : TILE_M;
                rows_of_block(m, &configured);
                panel_pair(act + m0 * I, I, I, panel(down, H, I, e, b), panel(down, H, I, e, b + 1), m, acc0, acc1,
                           m0 == start_of(offsets, e) ? ahead : NOTHING_AHEAD);
                for (int r = 0; r < m; r++) {
                    uint16_t *row = y + (m0 + r) * H + b * TILE_N;
                    store_bf16x16(acc0 + r * TILE_N, row);
                    store_bf16x16(acc1 + r * TILE_N, row + TILE_N);
                }
            }
        }
        release_tiles(configured);
    }
}

/* x [P, H] bf16 sorted by expert; offsets [E] int32 (end of each expert's rows); row_weight
 * [P] fp32; gate_up, down packed as above; y [P, H] bf16. H and I multiples of 32. Returns
 * 0, or -1 without scratch memory. */
int panels_experts(const uint16_t *x, int64_t P, int64_t H, const int32_t *offsets, int64_t E, const float *row_weight,
                    const uint16_t *gate_up, const uint16_t *down, int64_t I, float limit, uint16_t *y, int nthreads) {
    if (P == 0) return 0;
    if (scratch_reserve(experts_scratch_bytes(P, E, I)) != 0) return -1;
    experts_products(x, P, H, offsets, E, row_weight, gate_up, down, I, limit, y, nthreads, take_experts_scratch(P, E, I));
    scratch_done();
    return 0;
}

#define LINEAR_ROWS 64 /* rows of x per task of panel_linear: its weight panels stay in L1 across them */

#ifdef __AMX_TILE__
#define ROW_STEP TILE_M /* rows a tile multiply takes */
#else
#define ROW_STEP VEC_ROWS /* rows a vector pass takes */
#endif

/* Rows per task: LINEAR_ROWS, or fewer (whole passes, as even as can be) where a narrow
 * product has too few panels to give every thread two tasks: a projection of one or two
 * panels would otherwise run on one thread while the others wait. */
static int64_t rows_per_task(int64_t M, int64_t panel_tasks, int nthreads) {
    int64_t groups = (M + LINEAR_ROWS - 1) / LINEAR_ROWS;
    const int64_t wanted = (2 * (int64_t)nthreads + panel_tasks - 1) / panel_tasks;
    if (groups < wanted) groups = wanted;
    const int64_t rows = ((M + groups - 1) / groups + ROW_STEP - 1) / ROW_STEP * ROW_STEP;
    return rows < LINEAR_ROWS ? rows : LINEAR_ROWS;
}

/* Plain products on the same panels, one per head: for each head h,
 *     y[:, h, :N] = x[:, h, :K] times W_h [N, K]^T      x [M, heads, K], y [M, heads, N] (bf16;
 *                                                       fp32 holding bf16 values with f32_out)
 * with W_h packed as above from W_h padded with zero rows to n_packed (a multiple of 32)
 * output channels, the heads' panels one after another; only the N real outputs are stored.
 * heads = 1 is a plain linear layer; more are the per-head products of absorbed MLA. K a
 * multiple of 32. fp32 sums, rounded to bf16 once. Tasks are (head, pair of panels,
 * `rows_per_task` rows). */
static int linear_products(const uint16_t *x, int64_t M, int64_t heads, int64_t K, const uint16_t *w, int64_t N,
                           int64_t n_packed, void *y, int f32_out, int nthreads) {
    const int64_t pairs = n_packed / (2 * TILE_N), rows = rows_per_task(M, heads * pairs, nthreads);
    const int64_t groups = (M + rows - 1) / rows;
    const int64_t lda = heads * K, ldy = heads * N;
    #pragma omp parallel num_threads(nthreads)
    {
        int configured = 0;
        float acc0[TILE_M * TILE_N], acc1[TILE_M * TILE_N];
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < heads * pairs * groups; task++) {
            const int64_t b = 2 * (task % pairs), g = task / pairs % groups, h = task / (pairs * groups);
            const int64_t end = (g + 1) * rows < M ? (g + 1) * rows : M;
            const uint16_t *wh = w + h * n_packed * K;
            Ahead ahead = NOTHING_AHEAD; /* the next task's panels: this thread's, but at its share's end */
            if (task + 1 < heads * pairs * groups) {
                const int64_t nb = 2 * ((task + 1) % pairs), nh = (task + 1) / (pairs * groups);
                const uint16_t *next = w + nh * n_packed * K;
                ahead = (Ahead){panel(next, n_packed, K, 0, nb), panel(next, n_packed, K, 0, nb + 1)};
            }
            for (int64_t m0 = g * rows; m0 < end; m0 += TILE_M) {
                int m = end - m0 < TILE_M ? (int)(end - m0) : TILE_M;
                rows_of_block(m, &configured);
                panel_pair(x + m0 * lda + h * K, lda, K, panel(wh, n_packed, K, 0, b), panel(wh, n_packed, K, 0, b + 1),
                           m, acc0, acc1, m0 == g * rows ? ahead : NOTHING_AHEAD);
                for (int half = 0; half < 2; half++) {
                    const int64_t c0 = (b + half) * TILE_N;
                    const int64_t valid = N - c0 < TILE_N ? (N - c0 > 0 ? N - c0 : 0) : TILE_N;
                    const float *acc = half ? acc1 : acc0;
                    for (int r = 0; r < m; r++) store_rounded(acc + r * TILE_N, valid, y, (m0 + r) * ldy + h * N + c0, f32_out);
                }
            }
        }
        release_tiles(configured);
    }
    return 0;
}

int panels_linear(const uint16_t *x, int64_t M, int64_t heads, int64_t K, const uint16_t *w, int64_t N,
                  int64_t n_packed, uint16_t *y, int nthreads) {
    return linear_products(x, M, heads, K, w, N, n_packed, y, 0, nthreads);
}

/* panels_linear with y fp32: each sum rounded to bf16, then stored widened (`F.linear(x,
 * W).float()` without its conversion pass: the LM head's logits, 32 x vocab of them). */
int panels_linear_f32(const uint16_t *x, int64_t M, int64_t heads, int64_t K, const uint16_t *w, int64_t N,
                      int64_t n_packed, float *y, int nthreads) {
    return linear_products(x, M, heads, K, w, N, n_packed, y, 1, nthreads);
}

/* Routed experts with the routing's bookkeeping in here too: ids [T, k] (experts 0..E-1) and
 * weights [T, k] fp32 per token; the (token, slot) pairs sorted by expert (stable), their rows
 * gathered, panels_experts, then each token's outputs added in expert order with a bf16
 * rounding after each add, as torch's index_add_ into a bf16 zero tensor does. y [T, H].
 * Returns 0, or -1 without scratch memory. */
int panels_routed(const uint16_t *x, int64_t T, int64_t H, const int64_t *ids, const float *weights, int64_t k,
                   int64_t E, const uint16_t *gate_up, const uint16_t *down, int64_t I, float limit,
                   const uint16_t *shared_gate_up, const uint16_t *shared_down, int64_t shared_I, uint16_t *y,
                   int nthreads) {
    const int64_t P = T * k, threads = nthreads > 0 ? nthreads : 1;
    const size_t shared_bytes = (size_t)(T * H) * sizeof(uint16_t), ones_bytes = (size_t)T * sizeof(float);
    const size_t pairs_bytes = (size_t)P * sizeof(int64_t), rows_bytes = (size_t)(P * H) * sizeof(uint16_t);
    size_t bytes = scratch_padded((size_t)E * sizeof(int32_t)) + scratch_padded(pairs_bytes) +
                   2 * scratch_padded(rows_bytes) + scratch_padded((size_t)P * sizeof(float)) +
                   scratch_padded((size_t)(threads * H) * sizeof(float)) + experts_scratch_bytes(P, E, I);
    if (shared_gate_up != NULL)
        bytes += scratch_padded(shared_bytes) + scratch_padded(ones_bytes) + experts_scratch_bytes(T, 1, shared_I);
    if (scratch_reserve(bytes) != 0) return -1;
    int32_t *offsets = memset(scratch_take((size_t)E * sizeof(int32_t)), 0, (size_t)E * sizeof(int32_t));
    int64_t *slot_of = scratch_take(pairs_bytes); /* pair -> sorted position */
    uint16_t *rows = scratch_take(rows_bytes), *out = scratch_take(rows_bytes);
    float *row_weight = scratch_take((size_t)P * sizeof(float));
    float *acc = scratch_take((size_t)(threads * H) * sizeof(float)); /* a token's sum, per thread */
    const ExpertsScratch routed_scratch = take_experts_scratch(P, E, I);
    uint16_t *shared = NULL; /* the shared expert's rows, when there is one */
    if (shared_gate_up != NULL) {
        shared = scratch_take(shared_bytes);
        float *ones = scratch_take(ones_bytes);
        const int32_t all_rows = (int32_t)T;
        for (int64_t t = 0; t < T; t++) ones[t] = 1.0f;
        experts_products(x, T, H, &all_rows, 1, ones, shared_gate_up, shared_down, shared_I, limit, shared, nthreads,
                         take_experts_scratch(T, 1, shared_I));
    }
    sort_pairs(ids, P, E, offsets, slot_of);
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 1)
    for (int64_t p = 0; p < P; p++) {
        memcpy(rows + slot_of[p] * H, x + (p / k) * H, (size_t)H * sizeof(uint16_t));
        row_weight[slot_of[p]] = weights[p];
    }
    experts_products(rows, P, H, offsets, E, row_weight, gate_up, down, I, limit, out, nthreads, routed_scratch);
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (T > 1)
    for (int64_t t = 0; t < T; t++) {
        float *sum = acc + (int64_t)omp_get_thread_num() * H;
        memset(sum, 0, (size_t)H * sizeof(float));
        for (int64_t n = 0, pair = -1; n < k; n++) {
            pair = next_pair(slot_of + t * k, k, pair);
            const uint16_t *src = out + pair * H;
            for (int64_t c = 0; c < H; c++) sum[c] += bf16_to_f32(src[c]);
        }
        if (shared != NULL) /* routed + shared, both rounded to bf16 first, as torch adds them */
            for (int64_t c = 0; c < H; c++)
                y[t * H + c] = f32_to_bf16(round_bf16(sum[c]) + bf16_to_f32(shared[t * H + c]));
        else
            for (int64_t c = 0; c < H; c++) y[t * H + c] = f32_to_bf16(sum[c]);
    }
    scratch_done();
    return 0;
}
