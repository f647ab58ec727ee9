/* Cache tables stored as int8 or fp8 (e4m3) rows with one fp32 scale each (`ScaledRows` in
 * cache/layers.py): a value reads as value * scale in fp32, rounded to the model dtype, as
 * torch's `ScaledRows.gather` reads it; a row is stored as `ScaledRows.quantize` stores it.
 * Kernels that include this header are rebuilt when it changes. */
#ifndef OXSERVE_SCALED_ROWS_H
#define OXSERVE_SCALED_ROWS_H
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "bf16x16.h"

enum { PLAIN = 0, INT8 = 1, FP8 = 2 }; /* what a table holds: the model dtype itself, or scaled rows */

/* FP8_VALUES[b]: the value of float8_e4m3fn byte b (finite-only: no infinities, S.1111.111
 * is NaN), filled once as the library loads. */
static float FP8_VALUES[256];

__attribute__((constructor)) static void fp8_values(void) {
    for (int b = 0; b < 256; b++) {
        const int exponent = (b >> 3) & 15, mantissa = b & 7;
        float v = exponent == 0 ? ldexpf((float)mantissa, -9) : ldexpf(8.0f + (float)mantissa, exponent - 10);
        if (exponent == 15 && mantissa == 7) v = NAN;
        FP8_VALUES[b] = b & 128 ? -v : v;
    }
}

/* Element i of a scaled table (`kind` INT8 or FP8) whose row has scale `scale`, in fp32. */
static inline float scaled_value(const void *values, int64_t i, float scale, int kind) {
    return (kind == INT8 ? (float)((const int8_t *)values)[i] : FP8_VALUES[((const uint8_t *)values)[i]]) * scale;
}

#ifdef __AVX512F__
/* 16 float8_e4m3fn bytes (as int32 lanes) as floats, exactly fp8_values' (a gather from the
 * table took longer than the bits): a normal byte's exponent rebiased (7 -> 127) and mantissa
 * moved up; a subnormal's mantissa times 2^-9; S.1111.111 a quiet NaN. */
static inline __m512 fp8_floats16(__m512i u) {
    const __m512i e = _mm512_and_si512(_mm512_srli_epi32(u, 3), _mm512_set1_epi32(15)), m = _mm512_and_si512(u, _mm512_set1_epi32(7));
    const __m512i normal = _mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(120)), 23), _mm512_slli_epi32(m, 20));
    const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(1.0f / 512.0f));
    __m512i bits = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), normal, _mm512_castps_si512(subnormal));
    bits = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7f)), _mm512_set1_epi32(0x7f)),
                                   bits, _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(_mm512_or_si512(bits, _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24)));
}
#endif

/* dst[dst_at ..) = `count` values of a scaled row from element `at` on, read in the model dtype
 * (bf16 bits when `bf16`, else fp32): scaled_value of each, 16 at a time in AVX-512 registers,
 * the same products and roundings. */
static inline void scaled_row(const void *values, int64_t at, int64_t count, float scale, int kind, int bf16, void *dst,
                              int64_t dst_at) {
    int64_t c = 0;
#ifdef __AVX512F__
    const __m512 s = _mm512_set1_ps(scale);
    for (; c + 16 <= count; c += 16) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)((const uint8_t *)values + at + c));
        const __m512 v = kind == INT8 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)) : fp8_floats16(_mm512_cvtepu8_epi32(bytes));
        const __m512 x = _mm512_mul_ps(v, s);
        if (bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)dst + dst_at + c), narrow16(x));
        else _mm512_storeu_ps((float *)dst + dst_at + c, x);
    }
#endif
    for (; c < count; c++) {
        const float x = scaled_value(values, at + c, scale, kind);
        if (bf16) ((uint16_t *)dst)[dst_at + c] = f32_to_bf16(x);
        else ((float *)dst)[dst_at + c] = x;
    }
}

/* The float8_e4m3fn byte nearest x, ties to the even byte, +-448 for larger magnitudes and
 * infinities, 0x7f for a NaN, as torch converts on CPU. Normal range (>= 2^-6): the fp32 bits
 * rounded to 3 mantissa bits, half to even, with the carry into the exponent, then rebiased
 * (127 -> 7); below it the multiple of 2^-9 nearest (half to even), whose count is the byte
 * (8 being the smallest normal). */
static inline uint8_t fp8_byte(float x) {
    union { float f; uint32_t u; } c = {.f = x};
    const uint8_t sign = (uint8_t)(c.u >> 24) & 0x80;
    const uint32_t a = c.u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7f;
    if (a < 0x3c800000u) return sign | (uint8_t)nearbyintf(fabsf(x) * 512.0f); /* below 2^-6 */
    const uint32_t code = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
    return sign | (uint8_t)(code > 0x7e ? 0x7e : code);
}

/* Row `row` of a scaled table = x [dim] (fp32): scale = max |x| / 127 (int8) or / 448 (fp8), 1
 * for a row of zeros or one holding a NaN (torch's amax is then NaN, and NaN > 0 is false);
 * values x / scale, rounded half to even and clamped to +-127 (int8; a NaN stores 0) or to the
 * nearest e4m3 value (fp8). */
static inline void quantize_row(const float *x, int64_t dim, int kind, void *values, float *scales, int64_t row) {
    float amax = 0.0f;
    for (int64_t d = 0; d < dim; d++) {
        const float a = fabsf(x[d]);
        if (amax == amax && !(a <= amax)) amax = a; /* a NaN, once met, stays */
    }
    const float scale = amax > 0.0f ? amax / (kind == INT8 ? 127.0f : 448.0f) : 1.0f;
    scales[row] = scale;
    for (int64_t d = 0; d < dim; d++) {
        const float v = x[d] / scale;
        if (kind == INT8) {
            const float r = nearbyintf(v); /* half to even, as torch.round */
            ((int8_t *)values)[row * dim + d] = (int8_t)(r >= 127.0f ? 127.0f : r <= -127.0f ? -127.0f : r == r ? r : 0.0f);
        } else {
            ((uint8_t *)values)[row * dim + d] = fp8_byte(v);
        }
    }
}

#endif
