/* Elementwise maths in plain C that gcc vectorises (no libm calls in the loop). Kernels that
 * include this header are rebuilt when it changes. */
#ifndef OXSERVE_VMATH_H
#define OXSERVE_VMATH_H
#include <stdint.h>

/* e^x in plain C that gcc vectorises: x = n ln2 + r, e^r by Cephes' degree-7 polynomial, times
 * 2^n put in the exponent bits. Within 2 ulp of expf for x in [-87, 88]; outside it saturates
 * there (e^-87 ~ 1.6e-38, e^88 ~ 1.7e38), which no sigmoid or silu here can tell apart from 0
 * or infinity after its division. NaN stays NaN. */
static inline float vexp(float x) {
    x = x > 88.0f ? 88.0f : x;
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.0f);
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) * (1 << 23)};
    return p * scale.f;
}

#define VDOT_SUMS 16 /* independent partial sums of vdot: the adds vectorise and overlap */

/* a . b over n floats, VDOT_SUMS partial sums then the tail (the same order for any caller) */
static inline float vdot(const float *restrict a, const float *restrict b, int64_t n) {
    float part[VDOT_SUMS] = {0};
    int64_t i = 0;
    for (; i + VDOT_SUMS <= n; i += VDOT_SUMS)
        for (int l = 0; l < VDOT_SUMS; l++) part[l] += a[i + l] * b[i + l];
    float sum = 0.0f;
    for (int l = 0; l < VDOT_SUMS; l++) sum += part[l];
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

#endif
