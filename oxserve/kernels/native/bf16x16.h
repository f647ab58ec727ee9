/* 16 floats <-> 16 bf16 in AVX-512 registers, bit for bit as bf16.h converts one value.
 *
 * Narrowing in integer arithmetic (round to nearest even, a NaN kept a quiet NaN) is about
 * ten instructions a vector, and a kernel that rounds each product where torch's bf16 ops do
 * spends most of its time there (hc_expand at 32 tokens: 18 us, 10 without its roundings).
 * AVX512-BF16's VCVTNEPS2BF16 does it in one, with the same rounding and the same quiet NaN,
 * but reads subnormal inputs as zeros, which torch does not: a vector holding a subnormal
 * (one VFPCLASSPS to find out) takes the integer path. */
#ifndef OXSERVE_BF16X16_H
#define OXSERVE_BF16X16_H
#ifdef __AVX512F__
#include <immintrin.h>
#include <stdint.h>

static inline __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m256i narrow16_integer(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    return _mm512_cvtepi32_epi16(
        _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}

/* f32_to_bf16 of 16 lanes */
static inline __m256i narrow16(__m512 v) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
    if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0x20) == 0, 1)) /* 0x20: subnormal */
        return (__m256i)_mm512_cvtneps_pbh(v);
#endif
    return narrow16_integer(v);
}

/* round_bf16 of 16 lanes */
static inline __m512 round16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow16(v)), 16));
}
#endif
#endif
