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

static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } c = {.f = f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40);
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#endif
