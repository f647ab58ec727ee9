/* Cache tables stored as int8 or fp8 (e4m3) rows with one fp32 scale each (`ScaledRows` in
 * cache/layers.py): a value reads as value * scale in fp32, rounded to the model dtype, as
 * torch's `ScaledRows.gather` reads it; a row is stored as `ScaledRows.quantize` stores it.
 * Kernels that include this header are rebuilt when it changes. */
#ifndef OXSERVE_SCALED_ROWS_H
#define OXSERVE_SCALED_ROWS_H
#include <math.h>
#include <stdint.h>

#include "bf16.h"

enum { PLAIN = 0, INT8 = 1, FP8 = 2 }; /* what a table holds: the model dtype itself, or scaled rows */

/* The value of each float8_e4m3fn byte (finite-only: no infinities, S.1111.111 is NaN). */
static inline void fp8_values(float lut[256]) {
    for (int b = 0; b < 256; b++) {
        const int exponent = (b >> 3) & 15, mantissa = b & 7;
        float v = exponent == 0 ? ldexpf((float)mantissa, -9) : ldexpf(8.0f + (float)mantissa, exponent - 10);
        if (exponent == 15 && mantissa == 7) v = NAN;
        lut[b] = b & 128 ? -v : v;
    }
}

/* Element i of a scaled table (`kind` INT8 or FP8; `lut` from fp8_values) whose row has scale
 * `scale`, as read in the model dtype (bf16 when `bf16`), in fp32. */
static inline float scaled_value(const void *values, int64_t i, float scale, int kind, const float *lut, int bf16) {
    const float x = (kind == INT8 ? (float)((const int8_t *)values)[i] : lut[((const uint8_t *)values)[i]]) * scale;
    return bf16 ? round_bf16(x) : x;
}

/* The float8_e4m3fn byte nearest x, ties to the even byte, +-448 for larger magnitudes and
 * infinities, 0x7f for a NaN, as torch converts on CPU: `lut` from fp8_values, whose bytes
 * 0 .. 0x7e are the non-negative values in increasing order. */
static inline uint8_t fp8_byte(float x, const float *lut) {
    const uint8_t sign = signbit(x) ? 0x80 : 0;
    const float a = fabsf(x);
    if (a != a) return sign | 0x7f;
    if (a >= lut[0x7e]) return sign | 0x7e;
    int lo = 0, hi = 0x7e; /* lut[lo] <= a < lut[hi] */
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (lut[mid] <= a) lo = mid;
        else hi = mid;
    }
    const float below = a - lut[lo], above = lut[hi] - a;
    return sign | (uint8_t)(below < above ? lo : above < below ? hi : (lo & 1 ? hi : lo));
}

/* Row `row` of a scaled table = x [dim] (fp32, finite: a NaN stores garbage, as in torch):
 * scale = max |x| / 127 (int8) or / 448 (fp8), 1 for a row of zeros; values x / scale, rounded
 * half to even and clamped to +-127 (int8) or to the nearest e4m3 value (fp8). */
static inline void quantize_row(const float *x, int64_t dim, int kind, const float *lut, void *values, float *scales,
                                int64_t row) {
    float amax = 0.0f;
    for (int64_t d = 0; d < dim; d++) amax = fmaxf(amax, fabsf(x[d]));
    const float scale = amax > 0.0f ? amax / (kind == INT8 ? 127.0f : 448.0f) : 1.0f;
    scales[row] = scale;
    for (int64_t d = 0; d < dim; d++) {
        const float v = x[d] / scale;
        if (kind == INT8) {
            const float r = nearbyintf(v); /* half to even, as torch.round */
            ((int8_t *)values)[row * dim + d] = (int8_t)(r >= 127.0f ? 127.0f : r <= -127.0f ? -127.0f : r == r ? r : 0.0f);
        } else {
            ((uint8_t *)values)[row * dim + d] = fp8_byte(v, lut);
        }
    }
}

#endif
