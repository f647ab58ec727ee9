/* Cache tables stored as int8 or fp8 (e4m3) rows with one fp32 scale each (`ScaledRows` in
 * cache/layers.py): a value reads as value * scale in fp32, rounded to the model dtype, as
 * torch's `ScaledRows.gather` reads it. Kernels that include this header are rebuilt when it
 * changes. */
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

#endif
