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
