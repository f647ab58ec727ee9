/* Routed experts in bf16 for the few rows a decode step gives each expert.
 *
 * Rows are sorted by expert; offsets[e] is the end of expert e's rows:
 *
 *     x rows:   | e0 e0 | e2 | e5 e5 e5 |         P rows of H bf16 values
 *     offsets:  [2, 2, 3, 3, 3, 6, ...]          (E entries)
 *
 * For each row m of expert e (I = the expert's intermediate width):
 *     g = x[m] . gate_up[e][n],  u = x[m] . gate_up[e][I + n]         (n < I; fp32 sums)
 *     act[m, n] = bf16(bf16(silu(min(g, limit))) * clamp(u, +-limit)) * row_weight[m]
 *     y[m, h]   = act[m] . down[e][h]                                  (h < H)
 * with each intermediate rounded to bf16 where the torch version (two grouped bf16 GEMMs and
 * bf16 elementwise ops) rounds it, so the two differ by summation order only.
 *
 * Why a kernel: torch runs this as two grouped GEMMs whose per-expert set-up (a weight
 * reorder per call on CPU) costs more than the few rows' arithmetic, so decode ran the
 * experts at about a quarter of their memory roofline. Here every expert weight row is read
 * once per call and used for all of that expert's rows while it is in L1. Two parallel
 * phases (gate/up, then down) over (expert, block of output channels) tasks, on torch's
 * OpenMP pool. Dot products use AVX512-BF16 where the CPU has it, else widen bf16 to fp32
 * (AVX-512F or AVX2), else plain C. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "scratch.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define NBLOCK 16 /* output channels per task */


static float dot(const uint16_t *a, const uint16_t *b, int64_t n) {
    int64_t k = 0;
    float sum = 0.0f;
#if defined(__AVX512BF16__)
    __m512 acc = _mm512_setzero_ps();
    for (; k + 32 <= n; k += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + k), (__m512bh)_mm512_loadu_si512(b + k));
    sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; k + 16 <= n; k += 16) {
        __m512 av = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + k))), 16));
        __m512 bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + k))), 16));
        acc = _mm512_fmadd_ps(av, bv, acc);
    }
    sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; k + 8 <= n; k += 8) {
        __m256 av = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(a + k))), 16));
        __m256 bv = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + k))), 16));
        acc = _mm256_fmadd_ps(av, bv, acc);
    }
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    sum = _mm_cvtss_f32(s);
#endif
    for (; k < n; k++) sum += bf16_to_f32(a[k]) * bf16_to_f32(b[k]);
    return sum;
}

/* out[j] = a[j * stride : ] . b for j < nx (1 to 4 rows of x against one weight row b): b
 * is loaded once for all of them, and the rows' sums are independent chains that the CPU
 * overlaps (one chain of dependent multiply-adds would wait on each one's latency). */
static void dots(const uint16_t *b, const uint16_t *a, int64_t stride, int nx, int64_t n, float *out) {
#if defined(__AVX512BF16__)
    if (n % 32 == 0) {
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        if (nx == 1) {  /* two chains over alternate halves of the row */
            int64_t k = 0;
            for (; k + 64 <= n; k += 64) {
                acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_loadu_si512(a + k), (__m512bh)_mm512_loadu_si512(b + k));
                acc[1] = _mm512_dpbf16_ps(acc[1], (__m512bh)_mm512_loadu_si512(a + k + 32), (__m512bh)_mm512_loadu_si512(b + k + 32));
            }
            if (k < n) acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_loadu_si512(a + k), (__m512bh)_mm512_loadu_si512(b + k));
            out[0] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
            return;
        }
        for (int64_t k = 0; k < n; k += 32) {
            __m512bh bv = (__m512bh)_mm512_loadu_si512(b + k);
            for (int j = 0; j < nx; j++)
                acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(a + j * stride + k), bv);
        }
        for (int j = 0; j < nx; j++) out[j] = _mm512_reduce_add_ps(acc[j]);
        return;
    }
#endif
    for (int j = 0; j < nx; j++) out[j] = dot(a + j * stride, b, n);
}

static inline int64_t start_of(const int32_t *offsets, int64_t e) { return e == 0 ? 0 : offsets[e - 1]; }

/* x [P, H] bf16; offsets [E] int32; row_weight [P] fp32; gate_up [E, 2I, H] bf16;
 * down [E, H, I] bf16; y [P, H] bf16. Returns 0, or -1 without scratch memory. */
int moe_bf16_experts(const uint16_t *x, int64_t P, int64_t H, const int32_t *offsets, int64_t E, const float *row_weight,
                     const uint16_t *gate_up, const uint16_t *down, int64_t I, float limit, uint16_t *y, int nthreads) {
    if (P == 0) return 0;
    if (scratch_reserve(scratch_padded((size_t)(P * I) * sizeof(uint16_t))) != 0) return -1;
    uint16_t *act = scratch_take((size_t)(P * I) * sizeof(uint16_t));
    int64_t blocks_i = (I + NBLOCK - 1) / NBLOCK, blocks_h = (H + NBLOCK - 1) / NBLOCK;

    #pragma omp parallel num_threads(nthreads)
    {
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < E * blocks_i; task++) {
            int64_t e = task / blocks_i, n0 = (task % blocks_i) * NBLOCK, n1 = n0 + NBLOCK < I ? n0 + NBLOCK : I;
            int64_t start = start_of(offsets, e), end = offsets[e];
            const uint16_t *w = gate_up + e * 2 * I * H;
            float gs[4], us[4];
            for (int64_t n = n0; n < n1; n++)
                for (int64_t m = start; m < end; m += 4) {
                    int nx = end - m < 4 ? (int)(end - m) : 4;
                    dots(w + n * H, x + m * H, H, nx, H, gs);
                    dots(w + (I + n) * H, x + m * H, H, nx, H, us);
                    for (int j = 0; j < nx; j++) {
                        float g = round_bf16(gs[j]), u = round_bf16(us[j]);
                        g = g > limit ? limit : g; /* clamps that keep a NaN, as torch's do */
                        u = u > limit ? limit : (u < -limit ? -limit : u);
                        float silu = round_bf16(g / (1.0f + expf(-g)));
                        act[(m + j) * I + n] = f32_to_bf16(round_bf16(silu * u) * row_weight[m + j]);
                    }
                }
        }
        /* the implicit barrier: every act row is complete before the down products read it */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < E * blocks_h; task++) {
            int64_t e = task / blocks_h, h0 = (task % blocks_h) * NBLOCK, h1 = h0 + NBLOCK < H ? h0 + NBLOCK : H;
            int64_t start = start_of(offsets, e), end = offsets[e];
            const uint16_t *w = down + e * H * I;
            float ys[4];
            for (int64_t h = h0; h < h1; h++)
                for (int64_t m = start; m < end; m += 4) {
                    int nx = end - m < 4 ? (int)(end - m) : 4;
                    dots(w + h * I, act + m * I, I, nx, I, ys);
                    for (int j = 0; j < nx; j++) y[(m + j) * H + h] = f32_to_bf16(ys[j]);
                }
        }
    }
    scratch_done();
    return 0;
}
