/* bfloat16 <-> float32, as torch converts: widening is exact; narrowing rounds to nearest
 * even and keeps a NaN a NaN. Kernels that include this header are rebuilt when it changes
 * (native.load hashes the package's headers with each source). */
#ifndef OXSERVE_BF16_H
#define OXSERVE_BF16_H
#include <stdint.h>

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)v << 16};
    return c.f;
}

/* Branch-free (a select, not a jump), so that loops rounding to bf16 vectorise. */
static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } c = {.f = f};
    const uint32_t nearest_even = (c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (c.u >> 16) | 0x40u;
    return (uint16_t)((c.u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : nearest_even);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* dst[0..count) = src[offset..offset+count) as fp32, from bf16 when is_bf16, else fp32 */
static inline void widen_row(const void *src, int64_t offset, int64_t count, int is_bf16, float *restrict dst) {
    if (is_bf16) {
        const uint16_t *p = (const uint16_t *)src + offset;
        for (int64_t k = 0; k < count; k++) dst[k] = bf16_to_f32(p[k]);
    } else {
        const float *p = (const float *)src + offset;
        for (int64_t k = 0; k < count; k++) dst[k] = p[k];
    }
}

/* dst[offset..offset+count) = src[0..count), rounded to bf16 when is_bf16, else fp32 */
static inline void narrow_row(const float *restrict src, int64_t count, int is_bf16, void *dst, int64_t offset) {
    if (is_bf16) {
        uint16_t *p = (uint16_t *)dst + offset;
        for (int64_t k = 0; k < count; k++) p[k] = f32_to_bf16(src[k]);
    } else {
        float *p = (float *)dst + offset;
        for (int64_t k = 0; k < count; k++) p[k] = src[k];
    }
}

#endif
