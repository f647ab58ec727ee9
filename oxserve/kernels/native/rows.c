/* Row-wise ops of a decode step that eager torch runs as several passes, each in one pass:
 *
 *   rms_norm_bf16  y = w * bf16(x * rsqrt(mean(x^2) + eps)), x, w, y bf16, fp32 inside: the
 *                  reference RMSNorm's roundings (oxserve/kernels/norm.py), 8 eager ops;
 *   argmax_rows    the index of each fp32 row's largest value, the first one on a tie, a NaN
 *                  counting as the largest (torch's argmax/max), which torch finds with a
 *                  reduction that is not vectorised (`oxserve bench kernels --ops
 *                  sampler.greedy`, AMD EPYC of docs/performance.md, 32 rows of 8192: 229 us;
 *                  this pass 56 us).
 *
 * Rows are split across OpenMP threads. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* sum of x[c]^2 over a bf16 row, fp32 */
static float sum_squares(const uint16_t *x, int64_t dim) {
    float total = 0.0f;
    int64_t c = 0;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; c + 16 <= dim; c += 16) {
        const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + c))), 16));
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    total = _mm512_reduce_add_ps(acc);
#endif
    for (; c < dim; c++) total += bf16_to_f32(x[c]) * bf16_to_f32(x[c]);
    return total;
}

void rms_norm_bf16(const uint16_t *x, int64_t rows, int64_t dim, const uint16_t *weight, float eps, uint16_t *y,
                   int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *in = x + r * dim;
        const float inv = 1.0f / sqrtf(sum_squares(in, dim) / (float)dim + eps);
        for (int64_t c = 0; c < dim; c++)
            y[r * dim + c] = f32_to_bf16(bf16_to_f32(weight[c]) * round_bf16(bf16_to_f32(in[c]) * inv));
    }
}

/* The first index of the row's largest value: a max pass, then the first index holding it;
 * a NaN anywhere makes the first NaN the answer. */
static int64_t argmax_row(const float *row, int64_t n) {
    float best = -INFINITY;
    int nan = 0;
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 top = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(row + i);
        top = _mm512_max_ps(v, top); /* a NaN lane of v keeps top */
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    best = _mm512_reduce_max_ps(top);
    nan = unordered != 0;
#endif
    for (; i < n; i++) {
        best = row[i] > best ? row[i] : best;
        nan |= row[i] != row[i];
    }
    for (i = 0; i < n; i++)
        if (nan ? row[i] != row[i] : row[i] == best) return i;
    return 0;
}

void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t row_stride, int64_t *out, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * row_stride, n);
}
