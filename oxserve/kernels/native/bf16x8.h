/* 8 floats <-> 8 bf16 in AVX2 registers, bit for bit as bf16.h converts one value (round to
 * nearest even, a NaN kept a quiet NaN), for the kernels' AVX2 builds. GCC's generic vectors
 * (`v8` in hc_gates.c) do the same arithmetic, but where a loop's trip count or a stream count
 * is a runtime value they keep the vectors on the stack and rebuild the rounding's constants in
 * every iteration: hc_expand at 32 tokens took ~50 us on a first-generation EPYC. */
#ifndef OXSERVE_BF16X8_H
#define OXSERVE_BF16X8_H
#ifdef __AVX2__
#include <immintrin.h>
#include <stdint.h>

static inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* f32_to_bf16 of 8 lanes, each in the low half of its 32 bits */
static inline __m256i bf16_lanes8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i nearest_even = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(nearest_even, quiet_nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

/* f32_to_bf16 of 8 lanes, packed (the lanes are below 2^16: no saturation) */
static inline __m128i narrow8(__m256 v) {
    const __m256i lanes = bf16_lanes8(v);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(lanes, lanes), 0xd8));
}

/* round_bf16 of 8 lanes */
static inline __m256 round8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_lanes8(v), 16)); }
#endif
#endif
