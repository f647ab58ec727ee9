/* The 16 x 16 block of 32-bit values r[i][j] -> r[j][i] in AVX-512 registers: pairs, then
 * quads, then 128-bit lanes. Kernels that include this header are rebuilt when it changes. */
#ifndef OXSERVE_TRANSPOSE16_H
#define OXSERVE_TRANSPOSE16_H
#if defined(__AVX512F__)
#include <immintrin.h>

static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int g = 0; g < 16; g += 8)
        for (int i = 0; i < 4; i++) {
            t[g + i] = _mm512_shuffle_f32x4(r[g + i], r[g + i + 4], 0x88);
            t[g + i + 4] = _mm512_shuffle_f32x4(r[g + i], r[g + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}
#endif
#endif
