/* W8A8 products for CPU: int8 weights x int8 activations, exact int32 accumulation.
 *
 * y[m, n] = (float)(sum_k xq[m, k] * wq[n, k]) * sx[m] * sw[n]
 *
 * xq, sx: each row of x quantized symmetrically to [-127, 127] with its own scale
 *         (sx = max|x| / 127, q = round-half-even(x / sx)); done here, per call.
 * wq, sw: per-output-channel int8 weights (any int8, -128 included: compressed-tensors
 *         writes it), K padded with zeros to a multiple of KSTEP (the caller pads once
 *         at load), and their fp32 scales.
 *
 * Grouped form (the routed experts): rows sorted by expert, offsets[e] = end of expert
 * e's rows, weights stacked [E, N, Kp]. A plain linear layer is the case E = 1.
 *
 * Why int16 multiply-adds rather than AVX2's u8 x s8 `maddubs`: the pairwise sums of
 * maddubs saturate at 32767 (255 * 127 * 2 does not fit), so it needs sign tricks per
 * pair; widening the weights to int16 once per tile and using `madd_epi16` (pairs summed
 * into int32: 2 * 128 * 127 fits) is exact and as fast; int32 sums overflow only past
 * K = 2^31 / 128^2 = 131072. Decode is bound
 * by reading the weights, which are read once per call; activations are small and stay in
 * cache. Work is split over (expert, block of output rows) with OpenMP: it links against
 * the libgomp that torch has already loaded, so the two share one thread pool. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define KSTEP 16    /* int16 lanes in one AVX2 register */
#define NBLOCK 16   /* output rows per task */

int w8a8_kstep(void) { return KSTEP; }

/* Quantize rows [M, K] (row stride K), each first multiplied by inv_smooth [K] when given,
 * into int16 values [M, Kp] (zero tail) with per-row scales sx. */
void w8a8_quantize_rows(const float *x, int64_t M, int64_t K, int64_t Kp, const float *inv_smooth, int16_t *xq, float *sx) {
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        float amax = 0.0f;
        for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(inv_smooth ? row[k] * inv_smooth[k] : row[k]));
        float s = amax > 0.0f ? amax / 127.0f : 1.0f;
        sx[m] = s;
        int16_t *q = xq + m * Kp;
        for (int64_t k = 0; k < K; k++) {
            float r = nearbyintf((inv_smooth ? row[k] * inv_smooth[k] : row[k]) / s);
            q[k] = (int16_t)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
        }
        for (int64_t k = K; k < Kp; k++) q[k] = 0;
    }
}

#ifdef __AVX2__
static inline int32_t hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

static inline __m256i widen(const int8_t *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }
#endif

/* acc[i][j] = dot(w row n + i, x row m + j) for i < nw (1 or 4), j < nx (1 or 2). */
static void tile(const int8_t *w, const int16_t *x, int64_t Kp, int nw, int nx, int32_t acc[4][2]) {
#ifdef __AVX2__
    if (nw == 4) {
        __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00;
        __m256i a20 = a00, a21 = a00, a30 = a00, a31 = a00;
        const int16_t *x1 = x + (nx == 2 ? Kp : 0);  /* nx == 1: the second column is ignored */
        for (int64_t k = 0; k < Kp; k += KSTEP) {
            __m256i x0v = _mm256_loadu_si256((const __m256i *)(x + k));
            __m256i x1v = _mm256_loadu_si256((const __m256i *)(x1 + k));
            __m256i w0 = widen(w + k), w1 = widen(w + Kp + k), w2 = widen(w + 2 * Kp + k), w3 = widen(w + 3 * Kp + k);
            a00 = _mm256_add_epi32(a00, _mm256_madd_epi16(w0, x0v));
            a01 = _mm256_add_epi32(a01, _mm256_madd_epi16(w0, x1v));
            a10 = _mm256_add_epi32(a10, _mm256_madd_epi16(w1, x0v));
            a11 = _mm256_add_epi32(a11, _mm256_madd_epi16(w1, x1v));
            a20 = _mm256_add_epi32(a20, _mm256_madd_epi16(w2, x0v));
            a21 = _mm256_add_epi32(a21, _mm256_madd_epi16(w2, x1v));
            a30 = _mm256_add_epi32(a30, _mm256_madd_epi16(w3, x0v));
            a31 = _mm256_add_epi32(a31, _mm256_madd_epi16(w3, x1v));
        }
        acc[0][0] = hsum(a00); acc[0][1] = hsum(a01);
        acc[1][0] = hsum(a10); acc[1][1] = hsum(a11);
        acc[2][0] = hsum(a20); acc[2][1] = hsum(a21);
        acc[3][0] = hsum(a30); acc[3][1] = hsum(a31);
        return;
    }
#endif
    for (int i = 0; i < nw; i++)
        for (int j = 0; j < nx; j++) {
            int32_t s = 0;
            for (int64_t k = 0; k < Kp; k++) s += (int32_t)w[i * Kp + k] * (int32_t)x[j * Kp + k];
            acc[i][j] = s;
        }
}

/* y rows [start, end) x output rows [n0, n1) of one expert. */
static void block(const int16_t *xq, const float *sx, int64_t start, int64_t end, const int8_t *w, const float *sw,
                  int64_t n0, int64_t n1, int64_t Kp, int64_t N, float *y) {
    int32_t acc[4][2];
    for (int64_t n = n0; n < n1;) {
        int nw = n + 4 <= n1 ? 4 : 1;
        for (int64_t m = start; m < end;) {
            int nx = m + 2 <= end ? 2 : 1;
            tile(w + n * Kp, xq + m * Kp, Kp, nw, nx, acc);
            for (int i = 0; i < nw; i++)
                for (int j = 0; j < nx; j++) y[(m + j) * N + n + i] = (float)acc[i][j] * sx[m + j] * sw[n + i];
            m += nx;
        }
        n += nw;
    }
}

/* x [P, K] fp32 rows sorted by expert; offsets [E] int32; w [E, N, Kp] int8; sw [E, N];
 * inv_smooth: NULL, or [E, K] per-input-channel factors applied to x before quantizing
 * (SmoothQuant; the weights carry the inverse); y [P, N] fp32.
 * Returns 0, or -1 if scratch memory could not be had. */
int w8a8_grouped(const float *x, int64_t P, int64_t K, const int32_t *offsets, int64_t E, const int8_t *w,
                 const float *sw, const float *inv_smooth, int64_t N, int64_t Kp, float *y, int nthreads) {
    if (P == 0) return 0;
    int16_t *xq = aligned_alloc(64, (size_t)(P * Kp * sizeof(int16_t) + 63) / 64 * 64);
    float *sx = malloc((size_t)P * sizeof(float));
    if (xq == NULL || sx == NULL) { free(xq); free(sx); return -1; }
    for (int64_t e = 0, start = 0; e < E; start = offsets[e], e++)
        w8a8_quantize_rows(x + start * K, offsets[e] - start, K, Kp, inv_smooth ? inv_smooth + e * K : NULL,
                           xq + start * Kp, sx + start);
    int64_t nblocks = (N + NBLOCK - 1) / NBLOCK;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t task = 0; task < E * nblocks; task++) {
        int64_t e = task / nblocks, n0 = (task % nblocks) * NBLOCK;
        int64_t start = e == 0 ? 0 : offsets[e - 1], end = offsets[e];
        if (end > start)
            block(xq, sx, start, end, w + e * N * Kp, sw + e * N, n0, n0 + NBLOCK < N ? n0 + NBLOCK : N, Kp, N, y);
    }
    free(xq);
    free(sx);
    return 0;
}

/* ---- packed panels ----------------------------------------------------------------------
 *
 * Weights are packed once at load into panels of PANEL output channels, one vector per
 * PANEL_K inputs of the panel's channels:
 *
 *     W [N, K] -> packed [Np/PANEL][Kp/PANEL_K][PANEL][PANEL_K]:
 *                 packed[b][p][n][t] = W[PANEL b + n][PANEL_K p + t]
 *
 * N padded with zero rows to Np (a multiple of 2 PANEL: panels go in pairs), K with zero
 * columns to Kp (a multiple of PANEL_K). Each weight vector is loaded once for PANEL_ROWS
 * rows, and the sums are the same integers as the int16 kernel's above, so the outputs are
 * bit for bit the same. w8a8_panel_width() and w8a8_panel_depth() give the packer PANEL and
 * PANEL_K.
 *
 * AVX512-VNNI: `vpdpbusd` multiplies unsigned bytes by signed bytes, four pairs summed into
 * each int32 lane without saturation, 16 channels x 4 inputs per 64-byte vector. Activations
 * are signed, so they are stored shifted, u = q + 128 in [1, 255], and the shift is taken
 * back exactly with each output channel's weight sum:
 *
 *     sum_k q[k] w[n, k] = sum_k u[k] w[n, k] - 128 * colsum[n],   colsum[n] = sum_k w[n, k]
 *
 * (|sum_k u w| <= 255 * 128 * K fits int32 for K <= MAX_PANEL_K).
 *
 * AVX2: 8 channels x 2 inputs per 16 bytes, widened to int16 on load and multiplied by a
 * broadcast pair of int16 activations with `madd_epi16` (pairs summed into int32, exact as
 * above). No shift, so colsum is not read. On the AVX2 cores of this project an int16
 * multiply-add instruction does 16 products in the time of two 8-lane fp32 FMAs: W8A8 saves
 * bytes there, not arithmetic. */
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || defined(__AVX2__)
#include "bf16.h"
#include "pairs.h"
#include "scratch.h"
#include "vmath.h"

#define H_CHUNK 256 /* output channels a token's sum keeps at once */
#define MAX_PANEL_K 65536

int w8a8_panels_available(void) { return 1; }

/* Rows read and written in bf16 or fp32 (`bf16` says which): element k of a row, and the row
 * `m` rows of `width` after x. */
static inline float element(const void *row, int64_t k, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)row)[k]) : ((const float *)row)[k];
}

static inline const void *row_of(const void *x, int64_t m, int64_t width, int bf16) {
    return (const char *)x + m * width * (bf16 ? 2 : 4);
}

/* The `valid` first of a panel's PANEL outputs into y from channel n0, rounded to bf16 or not. */
static inline void put_outputs(const float *out, int64_t valid, void *y, int64_t n0, int bf16) {
    if (bf16)
        for (int64_t c = 0; c < valid; c++) ((uint16_t *)y)[n0 + c] = f32_to_bf16(out[c]);
    else
        memcpy((float *)y + n0, out, (size_t)valid * sizeof(float));
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PANEL 16
#define PANEL_K 4
#define PANEL_ROWS 8 /* rows a pass: 16 accumulators, two weight vectors and a broadcast in registers */
typedef uint8_t Act; /* a quantized activation as the products read it: q + 128 */
typedef __m512i Acc;

/* Inputs k..k+15 of a bf16 or fp32 row as fp32. */
static inline __m512 load16(const void *row, int64_t k, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)row + k);
    const __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + k));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

/* As w8a8_quantize_rows, into shifted bytes q + 128 (128 in the padding: q = 0), 16 inputs a
 * vector: the same IEEE divisions and round-half-even, so the same bytes. */
static void quantize_row(const void *row, int bf16, int64_t K, int64_t Kp, const float *inv_smooth, uint8_t *q,
                         float *sx) {
    __m512 top = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 v = load16(row, k, bf16);
        if (inv_smooth) v = _mm512_mul_ps(v, _mm512_loadu_ps(inv_smooth + k));
        top = _mm512_max_ps(_mm512_abs_ps(v), top);
    }
    float amax = _mm512_reduce_max_ps(top);
    for (int64_t i = k; i < K; i++) {
        const float v = element(row, i, bf16);
        amax = fmaxf(amax, fabsf(inv_smooth ? v * inv_smooth[i] : v));
    }
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    *sx = s;
    const __m512 scale = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (k = 0; k + 16 <= K; k += 16) {
        __m512 v = load16(row, k, bf16);
        if (inv_smooth) v = _mm512_mul_ps(v, _mm512_loadu_ps(inv_smooth + k));
        const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(v, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i shifted = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi)),
                                                 _mm512_set1_epi32(128));
        _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtepi32_epi8(shifted));
    }
    for (; k < K; k++) {
        const float v = element(row, k, bf16);
        const float r = nearbyintf((inv_smooth ? v * inv_smooth[k] : v) / s);
        q[k] = (uint8_t)((int)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r)) + 128);
    }
    for (k = K; k < Kp; k++) q[k] = 128;
}

/* `rows` (a constant after inlining) rows of shifted bytes against two panels. */
static inline __attribute__((always_inline)) void panel_rows(const uint8_t *x, int64_t Kp, const int8_t *w0,
                                                             const int8_t *w1, const int rows, Acc *acc0, Acc *acc1) {
    __m512i c0[PANEL_ROWS], c1[PANEL_ROWS];
    for (int r = 0; r < rows; r++) c0[r] = c1[r] = _mm512_setzero_si512();
    for (int64_t p = 0; p < Kp / 4; p++) {
        const __m512i b0 = _mm512_loadu_si512(w0 + p * 4 * PANEL), b1 = _mm512_loadu_si512(w1 + p * 4 * PANEL);
        for (int r = 0; r < rows; r++) {
            int32_t quad;
            memcpy(&quad, x + r * Kp + 4 * p, sizeof quad);
            const __m512i a = _mm512_set1_epi32(quad);
            c0[r] = _mm512_dpbusd_epi32(c0[r], a, b0);
            c1[r] = _mm512_dpbusd_epi32(c1[r], a, b1);
        }
    }
    for (int r = 0; r < rows; r++) {
        acc0[r] = c0[r];
        acc1[r] = c1[r];
    }
}

/* out[n] = (float)(sum - 128 colsum[n]) * sx[m] * sw[n] for the `valid` channels from n0. */
static void panel_outputs(Acc sum, const int32_t *colsum, const float *sw, float sx, int64_t n0, int64_t valid,
                          float *out) {
    const __mmask16 keep = (__mmask16)((1u << valid) - 1u);
    const __m512i exact = _mm512_sub_epi32(sum, _mm512_slli_epi32(_mm512_loadu_si512(colsum + n0), 7));
    const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(sx));
    _mm512_storeu_ps(out, _mm512_mul_ps(scaled, _mm512_maskz_loadu_ps(keep, sw + n0)));
}
#else
#define PANEL 8
#define PANEL_K 2
#define PANEL_ROWS 4 /* rows a pass: 8 accumulators, two widened weight vectors, a broadcast */
typedef int16_t Act; /* a quantized activation, q itself */
typedef __m256i Acc;

/* Inputs k..k+7 of a bf16 or fp32 row as fp32. */
static inline __m256 load8(const void *row, int64_t k, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)row + k);
    const __m128i bits = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

/* As w8a8_quantize_rows, 8 inputs a vector: the same IEEE divisions and round-half-even, so
 * the same values (0 in the padding). */
static void quantize_row(const void *row, int bf16, int64_t K, int64_t Kp, const float *inv_smooth, int16_t *q,
                         float *sx) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 top = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 v = load8(row, k, bf16);
        if (inv_smooth) v = _mm256_mul_ps(v, _mm256_loadu_ps(inv_smooth + k));
        top = _mm256_max_ps(_mm256_and_ps(v, magnitude), top); /* passes a NaN over, as fmaxf does */
    }
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, top);
    for (int i = 0; i < 8; i++) amax = fmaxf(amax, lanes[i]);
    for (int64_t i = k; i < K; i++) {
        const float v = element(row, i, bf16);
        amax = fmaxf(amax, fabsf(inv_smooth ? v * inv_smooth[i] : v));
    }
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    *sx = s;
    const __m256 scale = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    for (k = 0; k + 8 <= K; k += 8) {
        __m256 v = load8(row, k, bf16);
        if (inv_smooth) v = _mm256_mul_ps(v, _mm256_loadu_ps(inv_smooth + k));
        const __m256 r = _mm256_round_ps(_mm256_div_ps(v, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i q32 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
        _mm_storeu_si128((__m128i *)(q + k), _mm_packs_epi32(_mm256_castsi256_si128(q32), _mm256_extracti128_si256(q32, 1)));
    }
    for (; k < K; k++) {
        const float v = element(row, k, bf16);
        const float r = nearbyintf((inv_smooth ? v * inv_smooth[k] : v) / s);
        q[k] = (int16_t)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
    }
    for (k = K; k < Kp; k++) q[k] = 0;
}

/* `rows` (a constant after inlining) rows of int16 activations against two panels: per input
 * pair, each panel's 8 x 2 weights widened once, each row's pair one broadcast. */
static inline __attribute__((always_inline)) void panel_rows(const int16_t *x, int64_t Kp, const int8_t *w0,
                                                             const int8_t *w1, const int rows, Acc *acc0, Acc *acc1) {
    __m256i c0[PANEL_ROWS], c1[PANEL_ROWS];
    for (int r = 0; r < rows; r++) c0[r] = c1[r] = _mm256_setzero_si256();
    for (int64_t p = 0; p < Kp / 2; p++) {
        const __m256i b0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w0 + p * 2 * PANEL)));
        const __m256i b1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w1 + p * 2 * PANEL)));
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x + r * Kp + 2 * p, sizeof pair);
            const __m256i a = _mm256_set1_epi32(pair);
            c0[r] = _mm256_add_epi32(c0[r], _mm256_madd_epi16(a, b0));
            c1[r] = _mm256_add_epi32(c1[r], _mm256_madd_epi16(a, b1));
        }
    }
    for (int r = 0; r < rows; r++) {
        acc0[r] = c0[r];
        acc1[r] = c1[r];
    }
}

/* out[n] = (float)sum * sx[m] * sw[n] for the `valid` channels from n0 (colsum: see above). */
static void panel_outputs(Acc sum, const int32_t *colsum, const float *sw, float sx, int64_t n0, int64_t valid,
                          float *out) {
    (void)colsum;
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(sx));
    _mm256_storeu_ps(out, _mm256_mul_ps(scaled, _mm256_maskload_ps(sw + n0, keep)));
}
#endif

/* One expert's weights: panels [Np/PANEL][Kp/PANEL_K][PANEL][PANEL_K], their channel sums [Np], scales [N], and
 * smoothing factors [K] for its inputs (NULL: none). */
typedef struct {
    const int8_t *panels;
    const int32_t *colsum;
    const float *sw, *inv_smooth;
    int64_t N, Np, K, Kp;
} Int8Weights;

static Int8Weights expert_weights(const int8_t *panels, const int32_t *colsum, const float *sw, const float *inv_smooth,
                                  int64_t e, int64_t N, int64_t Np, int64_t K, int64_t Kp) {
    Int8Weights w = {panels + e * Np * Kp, colsum + e * Np, sw + e * N, inv_smooth ? inv_smooth + e * K : NULL,
                     N, Np, K, Kp};
    return w;
}

/* Rows [start, end) of quantized activations xq (row scales sx) times one pair of panels (from
 * channel 2 PANEL b2), into y's rows (`ldy` apart; bf16 when y_bf16, else fp32). */
static void pair_products(const Act *xq, const float *sx, int64_t start, int64_t end, const Int8Weights *w,
                          int64_t b2, void *y, int y_bf16, int64_t ldy) {
    const int8_t *w0 = w->panels + b2 * 2 * PANEL * w->Kp, *w1 = w0 + PANEL * w->Kp;
    Acc acc0[PANEL_ROWS], acc1[PANEL_ROWS];
    for (int64_t m0 = start; m0 < end; m0 += PANEL_ROWS) {
        const Act *xm = xq + m0 * w->Kp;
        const int64_t Kp = w->Kp;
        switch (end - m0 < PANEL_ROWS ? end - m0 : PANEL_ROWS) { /* a constant row count per case */
        case 1: panel_rows(xm, Kp, w0, w1, 1, acc0, acc1); break;
        case 2: panel_rows(xm, Kp, w0, w1, 2, acc0, acc1); break;
        case 3: panel_rows(xm, Kp, w0, w1, 3, acc0, acc1); break;
#if PANEL_ROWS == 8
        case 4: panel_rows(xm, Kp, w0, w1, 4, acc0, acc1); break;
        case 5: panel_rows(xm, Kp, w0, w1, 5, acc0, acc1); break;
        case 6: panel_rows(xm, Kp, w0, w1, 6, acc0, acc1); break;
        case 7: panel_rows(xm, Kp, w0, w1, 7, acc0, acc1); break;
#endif
        default: panel_rows(xm, Kp, w0, w1, PANEL_ROWS, acc0, acc1); break;
        }
        for (int64_t r = 0; r < PANEL_ROWS && m0 + r < end; r++) {
            void *row = (void *)row_of(y, m0 + r, ldy, y_bf16);
            for (int half = 0; half < 2; half++) {
                const Acc sum = half ? acc1[r] : acc0[r];
                const int64_t n0 = (2 * b2 + half) * PANEL, valid = w->N - n0 < PANEL ? w->N - n0 : PANEL;
                if (valid <= 0) continue;
                float out[PANEL];
                panel_outputs(sum, w->colsum, w->sw, sx[m0 + r], n0, valid, out);
                put_outputs(out, valid, row, n0, y_bf16);
            }
        }
    }
}

static inline int64_t expert_of(const int32_t *offsets, int64_t m) {
    int64_t e = 0;
    while (offsets[e] <= m) e++;
    return e;
}

/* Rows per task: all of an expert's where there are enough (expert, pair of panels) tasks to
 * give every thread two, else whole passes of PANEL_ROWS, as even as can be: a narrow product
 * (a projection of a panel pair or two) would otherwise run on one thread while the rest wait. */
static int64_t rows_per_task(int64_t P, int64_t tasks, int nthreads) {
    const int64_t groups = (2 * (int64_t)nthreads + tasks - 1) / tasks;
    if (groups <= 1 || P <= PANEL_ROWS) return P > 0 ? P : 1;
    return ((P + groups - 1) / groups + PANEL_ROWS - 1) / PANEL_ROWS * PANEL_ROWS;
}

/* A packed weight stack as the products and entry points take it (`PanelStack` in kernels/int8.py):
 * panels [E][Np/PANEL][Kp/PANEL_K][PANEL][PANEL_K], colsum [E, Np], scales sw [E, N] and
 * smoothing factors [E, K] (NULL: none). */
typedef struct {
    const int8_t *panels;
    const int32_t *colsum;
    const float *sw, *smooth;
    int64_t Np, Kp;
} Stack;

/* The quantized rows of x [P, K] (sorted by expert, each with its expert's smoothing) and
 * their products with every expert's weights w (N outputs), into y [P, N]; x and y bf16 where
 * their flags say, else fp32. Tasks are (expert, row group, pair of panels).
 *
 * Every thread of the enclosing OpenMP team calls it: its two loops are the team's, each
 * ending at a barrier. So an MLP (gate|up, activation, down) or the routed experts with their
 * shared one run in one team: a team per product paid a fork and a join each (1.3 us on a
 * warm 2-core EPYC, more in a decode step), ~20 us of a batch-1 routed call. */
static void grouped_products(const void *x, int x_bf16, int64_t P, const int32_t *offsets, int64_t E, const Stack *w,
                             int64_t N, int64_t K, Act *xq, float *sx, void *y, int y_bf16) {
    const int8_t *panels = w->panels;
    const int32_t *colsum = w->colsum;
    const float *sw = w->sw, *inv_smooth = w->smooth;
    const int64_t Np = w->Np, Kp = w->Kp;
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < P; m++)
        quantize_row(row_of(x, m, K, x_bf16), x_bf16, K, Kp,
                     inv_smooth ? inv_smooth + expert_of(offsets, m) * K : NULL, xq + m * Kp, sx + m);
    const int64_t pairs = Np / (2 * PANEL), rows = rows_per_task(P, E * pairs, omp_get_num_threads());
    const int64_t groups = (P + rows - 1) / rows;
    #pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < E * groups * pairs; task++) {
        const int64_t e = task / (groups * pairs), g = task / pairs % groups;
        const int64_t start = (e == 0 ? 0 : offsets[e - 1]) + g * rows;
        const int64_t end = start + rows < offsets[e] ? start + rows : offsets[e];
        if (start >= end) continue;
        const Int8Weights expert = expert_weights(panels, colsum, sw, inv_smooth, e, N, Np, K, Kp);
        pair_products(xq, sx, start, end, &expert, task % pairs, y, y_bf16, N);
    }
}

/* Quantized rows and their scales for P rows of Kp inputs. */
static size_t rows_bytes(int64_t P, int64_t Kp) { return scratch_padded((size_t)(P * Kp) * sizeof(Act)) + scratch_padded((size_t)P * sizeof(float)); }

/* As w8a8_grouped, on weights packed as above: panels [E][Np/PANEL][Kp/PANEL_K][PANEL][PANEL_K],
 * colsum [E, Np] int32, sw [E, N]. Returns 0, -1 without scratch memory,
 * -3 for K above MAX_PANEL_K. */
int w8a8_panels_grouped(const float *x, int64_t P, int64_t K, const int32_t *offsets, int64_t E, const int8_t *panels,
                        const int32_t *colsum, const float *sw, const float *inv_smooth, int64_t N, int64_t Np,
                        int64_t Kp, float *y, int nthreads) {
    if (Kp > MAX_PANEL_K) return -3;
    if (P == 0) return 0;
    if (scratch_reserve(rows_bytes(P, Kp)) != 0) return -1;
    Act *xq = scratch_take((size_t)(P * Kp) * sizeof(Act));
    float *sx = scratch_take((size_t)P * sizeof(float));
    const Stack w = {panels, colsum, sw, inv_smooth, Np, Kp};
    #pragma omp parallel num_threads(nthreads)
    grouped_products(x, 0, P, offsets, E, &w, N, K, xq, sx, y, 0);
    scratch_done();
    return 0;
}

/* A plain linear layer (one expert) on x [M, K] and into y [M, N], each bf16 when its flag
 * says so, else fp32: no conversions around the call. Returns as w8a8_panels_grouped. */
int w8a8_panels_linear(const void *x, int x_bf16, int64_t M, int64_t K, const int8_t *panels, const int32_t *colsum,
                       const float *sw, const float *inv_smooth, int64_t N, int64_t Np, int64_t Kp, void *y,
                       int y_bf16, int nthreads) {
    if (Kp > MAX_PANEL_K) return -3;
    if (M == 0) return 0;
    if (scratch_reserve(rows_bytes(M, Kp)) != 0) return -1;
    Act *xq = scratch_take((size_t)(M * Kp) * sizeof(Act));
    float *sx = scratch_take((size_t)M * sizeof(float));
    const int32_t rows = (int32_t)M;
    const Stack w = {panels, colsum, sw, inv_smooth, Np, Kp};
    #pragma omp parallel num_threads(nthreads)
    grouped_products(x, x_bf16, M, &rows, 1, &w, N, K, xq, sx, y, y_bf16);
    scratch_done();
    return 0;
}

/* Scratch for P rows of an MLP of width H and intermediate width I. */
typedef struct {
    float *in; /* [P, max(H, I)]: the rows, then the activations */
    float *h;  /* [P, max(2I, H)]: gate|up, then the outputs */
    float *sx;
    Act *xq;
} MlpScratch;

static size_t in_bytes(int64_t P, int64_t H, int64_t I) { return (size_t)(P * (H > I ? H : I)) * sizeof(float); }
static size_t h_bytes(int64_t P, int64_t H, int64_t I) { return (size_t)(P * (2 * I > H ? 2 * I : H)) * sizeof(float); }
static int64_t wider(const Stack *gu, const Stack *d) { return gu->Kp > d->Kp ? gu->Kp : d->Kp; }

/* What an MLP's scratch takes from the arena (a sum of padded sizes). */
static size_t scratch_bytes(int64_t P, int64_t H, int64_t I, const Stack *gu, const Stack *d) {
    return scratch_padded(in_bytes(P, H, I)) + scratch_padded(h_bytes(P, H, I)) + rows_bytes(P, wider(gu, d));
}

static MlpScratch take_scratch(int64_t P, int64_t H, int64_t I, const Stack *gu, const Stack *d) {
    MlpScratch s;
    s.in = scratch_take(in_bytes(P, H, I));
    s.h = scratch_take(h_bytes(P, H, I));
    s.xq = scratch_take((size_t)(P * wider(gu, d)) * sizeof(Act));
    s.sx = scratch_take((size_t)P * sizeof(float));
    return s;
}

/* Each expert's MLP on its rows s->in [P, H] (fp32, sorted by expert: offsets [E]): gate|up
 * products (N = 2I, K = H), act = silu(min(gate, limit)) * clamp(up, +-limit) * the row's
 * weight (1 without row_weight) in fp32, down products (N = H, K = I) into s->h [P, H]. Called
 * by every thread of a team, as grouped_products. */
static void expert_mlps(MlpScratch *s, int64_t P, const int32_t *offsets, int64_t E, const float *row_weight, int64_t H,
                        int64_t I, float limit, const Stack *gu, const Stack *d) {
    grouped_products(s->in, 0, P, offsets, E, gu, 2 * I, H, s->xq, s->sx, s->h, 0);
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < P; m++) {
        const float *gate = s->h + m * 2 * I, *up = gate + I;
        const float w = row_weight ? row_weight[m] : 1.0f;
        float *act = s->in + m * I;
        for (int64_t c = 0; c < I; c++) {
            const float g = gate[c] < limit ? gate[c] : limit;
            const float u = up[c] < -limit ? -limit : (up[c] > limit ? limit : up[c]);
            act[c] = g / (1.0f + vexp(-g)) * u * w;
        }
    }
    grouped_products(s->in, 0, P, offsets, E, d, H, I, s->xq, s->sx, s->h, 0);
}

/* A dense MLP (a shared expert: one expert, every row at weight 1) on x [T, H] (bf16 when
 * x_bf16, else fp32) into s->h [T, H] fp32. Called by every thread of a team. */
static void dense_mlp(const void *x, int x_bf16, int64_t T, int64_t H, int64_t I, float limit, const Stack *gu,
                      const Stack *d, MlpScratch *s) {
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) widen_row(x, t * H, H, x_bf16, s->in + t * H);
    const int32_t rows = (int32_t)T;
    expert_mlps(s, T, &rows, 1, NULL, H, I, limit, gu, d);
}

/* A dense SiLU MLP in one call: dense_mlp, rounded into y [T, H] in x's dtype. Returns 0, -1
 * without scratch memory, -3 for a width above MAX_PANEL_K. */
int w8a8_panels_mlp(const void *x, int x_bf16, int64_t T, int64_t H, int64_t I, float limit, const Stack *gu,
                    const Stack *d, void *y, int nthreads) {
    if (gu->Kp > MAX_PANEL_K || d->Kp > MAX_PANEL_K) return -3;
    if (scratch_reserve(scratch_bytes(T, H, I, gu, d)) != 0) return -1;
    MlpScratch s = take_scratch(T, H, I, gu, d);
    #pragma omp parallel num_threads(nthreads)
    {
        dense_mlp(x, x_bf16, T, H, I, limit, gu, d, &s);
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) narrow_row(s.h + t * H, H, x_bf16, y, t * H);
    }
    scratch_done();
    return 0;
}

/* Token t's output of the routed experts: its k pairs' outputs (rows of h, rounded to the
 * dtype) summed in fp32 in expert order, plus the shared expert's row (NULL: none), both
 * rounded to the dtype first, rounded once into y's row t. */
static void token_output(int64_t t, int64_t k, int64_t H, const int64_t *slot_of, const float *h, const float *shared_h,
                         int bf16, void *y) {
    float sum[H_CHUNK];
    for (int64_t c0 = 0; c0 < H; c0 += H_CHUNK) {
        const int64_t n = H - c0 < H_CHUNK ? H - c0 : H_CHUNK;
        for (int64_t c = 0; c < n; c++) sum[c] = 0.0f;
        for (int64_t j = 0, pair = -1; j < k; j++) {
            pair = next_pair(slot_of + t * k, k, pair);
            const float *out = h + pair * H + c0;
            for (int64_t c = 0; c < n; c++) sum[c] += bf16 ? round_bf16(out[c]) : out[c];
        }
        if (shared_h) {
            const float *add = shared_h + t * H + c0;
            for (int64_t c = 0; c < n; c++) sum[c] = bf16 ? round_bf16(sum[c]) + round_bf16(add[c]) : sum[c] + add[c];
        }
        narrow_row(sum, n, bf16, y, t * H + c0);
    }
}

/* Routed experts in one call: the (token, slot) pairs of ids [T, k] sorted by expert (stable),
 * their rows of x [T, H] (bf16 when x_bf16, else fp32) gathered, expert_mlps with the pairs'
 * weights, each pair's output rounded to x's dtype, then each token's outputs summed in fp32 in
 * expert order and rounded once into y [T, H]. With a shared expert (shared_gu and shared_d,
 * intermediate width shared_I; else NULL), its dense_mlp output is added as MoE.forward adds
 * it: both rounded to x's dtype first. Returns 0, -1 without scratch memory, -3 for a width
 * above MAX_PANEL_K. */
int w8a8_panels_routed(const void *x, int x_bf16, int64_t T, int64_t H, const int64_t *ids, const float *weights,
                       int64_t k, int64_t E, int64_t I, float limit, const Stack *gu, const Stack *d,
                       const Stack *shared_gu, const Stack *shared_d, int64_t shared_I, void *y, int nthreads) {
    if (gu->Kp > MAX_PANEL_K || d->Kp > MAX_PANEL_K) return -3;
    if (shared_gu && (shared_gu->Kp > MAX_PANEL_K || shared_d->Kp > MAX_PANEL_K)) return -3;
    const int64_t P = T * k;
    size_t bytes = scratch_padded((size_t)E * sizeof(int32_t)) + scratch_padded((size_t)P * sizeof(int64_t)) +
                   scratch_padded((size_t)P * sizeof(float)) + scratch_bytes(P, H, I, gu, d);
    if (shared_gu) bytes += scratch_bytes(T, H, shared_I, shared_gu, shared_d);
    if (scratch_reserve(bytes) != 0) return -1;
    int32_t *offsets = memset(scratch_take((size_t)E * sizeof(int32_t)), 0, (size_t)E * sizeof(int32_t));
    int64_t *slot_of = scratch_take((size_t)P * sizeof(int64_t));
    float *row_weight = scratch_take((size_t)P * sizeof(float));
    MlpScratch s = take_scratch(P, H, I, gu, d), shared = {0};
    if (shared_gu) shared = take_scratch(T, H, shared_I, shared_gu, shared_d);
    sort_pairs(ids, P, E, offsets, slot_of);
    #pragma omp parallel num_threads(nthreads)
    {
        if (shared_gu) dense_mlp(x, x_bf16, T, H, shared_I, limit, shared_gu, shared_d, &shared);
        #pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) {
            widen_row(x, (p / k) * H, H, x_bf16, s.in + slot_of[p] * H);
            row_weight[slot_of[p]] = weights[p];
        }
        expert_mlps(&s, P, offsets, E, row_weight, H, I, limit, gu, d);
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) token_output(t, k, H, slot_of, s.h, shared_gu ? shared.h : NULL, x_bf16, y);
    }
    scratch_done();
    return 0;
}

int w8a8_panel_width(void) { return PANEL; }
int w8a8_panel_depth(void) { return PANEL_K; }
#else
int w8a8_panels_available(void) { return 0; }
int w8a8_panel_width(void) { return 0; }
int w8a8_panel_depth(void) { return 0; }

int w8a8_panels_grouped(void) { return -2; }  /* built without AVX2: never called (panels_available) */
int w8a8_panels_routed(void) { return -2; }
int w8a8_panels_mlp(void) { return -2; }
int w8a8_panels_linear(void) { return -2; }
#endif
