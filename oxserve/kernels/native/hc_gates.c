/* mHC gates for a batch of tokens, in one pass: the eager torch version is ~120 tiny ops
 * (20 Sinkhorn iterations on N x N matrices), which on CPU costs ~1 ms whatever the batch.
 *
 * mixed [T, (2+N)N]: the normalised streams projected to (pre | post | comb) logits.
 * pre  [T, N]    = sigmoid(mixed_pre * scale[0] + base_pre) + eps
 * post [T, N]    = 2 sigmoid(mixed_post * scale[1] + base_post)
 * comb [T, N, N] = softmax over each row of (mixed_comb * scale[2] + base_comb), + eps,
 *                  then columns normalised, then (iters - 1) times rows and columns.
 *
 * Tokens are worked LANES at a time, transposed so that the innermost loop runs across
 * tokens: the compiler turns it into vector divides and adds. Same operations, same order
 * as the torch version (exact divides, no fast-math), so results agree to rounding. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "bf16x16.h"
#include "bf16x8.h"
#include "scratch.h"

#define LANES 8
#define MAX_N 16

static float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* m[k][l]: element k = i * n + j of the N x N matrix of lane l. */
static void normalise(float m[][LANES], int n, int rows, float eps) {
    for (int a = 0; a < n; a++) {
        float sum[LANES] = {0};
        for (int b = 0; b < n; b++) {
            const float *e = m[rows ? a * n + b : b * n + a];
            for (int l = 0; l < LANES; l++) sum[l] += e[l];
        }
        for (int l = 0; l < LANES; l++) sum[l] += eps;
        for (int b = 0; b < n; b++) {
            float *e = m[rows ? a * n + b : b * n + a];
            for (int l = 0; l < LANES; l++) e[l] /= sum[l];
        }
    }
}

static void row_softmax(float m[][LANES], int n, float eps) {
    for (int i = 0; i < n; i++) {
        float top[LANES], sum[LANES] = {0};
        for (int l = 0; l < LANES; l++) top[l] = m[i * n][l];
        for (int j = 1; j < n; j++)
            for (int l = 0; l < LANES; l++) top[l] = m[i * n + j][l] > top[l] ? m[i * n + j][l] : top[l];
        for (int j = 0; j < n; j++)
            for (int l = 0; l < LANES; l++) sum[l] += (m[i * n + j][l] = expf(m[i * n + j][l] - top[l]));
        for (int j = 0; j < n; j++)
            for (int l = 0; l < LANES; l++) m[i * n + j][l] = m[i * n + j][l] / sum[l] + eps;
    }
}

/* The gates of tokens t0 .. t0 + lanes (lanes <= LANES), from their rows of mixed (`mixed`
 * points at token t0's), into pre, post and comb at those tokens. */
static void gates_block(const float *mixed, const float *base, const float *scale, int64_t t0, int lanes, int n,
                        int iters, float eps, float *pre, float *post, float *comb) {
    const int width = (2 + n) * n, nn = n * n;
    float block[MAX_N * MAX_N][LANES];
    for (int l = 0; l < lanes; l++) {
        const float *x = mixed + l * width;
        const int64_t t = t0 + l;
        for (int j = 0; j < n; j++) {
            pre[t * n + j] = sigmoidf(x[j] * scale[0] + base[j]) + eps;
            post[t * n + j] = 2.0f * sigmoidf(x[n + j] * scale[1] + base[n + j]);
        }
    }
    for (int k = 0; k < nn; k++)
        for (int l = 0; l < LANES; l++)  /* idle lanes repeat the block's first token */
            block[k][l] = mixed[(l < lanes ? l : 0) * width + 2 * n + k] * scale[2] + base[2 * n + k];
    row_softmax(block, n, eps);
    normalise(block, n, 0, eps);
    for (int it = 1; it < iters; it++) {
        normalise(block, n, 1, eps);
        normalise(block, n, 0, eps);
    }
    for (int l = 0; l < lanes; l++)
        for (int k = 0; k < nn; k++) comb[(t0 + l) * nn + k] = block[k][l];
}

/* Returns 0, or -1 when n is above MAX_N (the caller then uses the torch version). Blocks of
 * LANES tokens are shared among `threads` threads. */
int hc_gates(const float *mixed, const float *base, const float *scale, int64_t tokens, int n,
             int iters, float eps, float *pre, float *post, float *comb, int threads) {
    if (n > MAX_N) return -1;
    const int width = (2 + n) * n;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens > LANES)
    for (int64_t t0 = 0; t0 < tokens; t0 += LANES)
        gates_block(mixed + t0 * width, base, scale, t0, tokens - t0 < LANES ? (int)(tokens - t0) : LANES, n, iters,
                    eps, pre, post, comb);
    return 0;
}

/* ---- the whole collapse and expand --------------------------------------------------------
 *
 * Streams are [T, N, D] in bf16 (is_bf16) or fp32; the torch version is ~10 eager ops per
 * call (dtype copies, a norm, a skinny product, two batched products), each costing more
 * than a decode step's few tokens of arithmetic. Same operations as `HyperConnection`, with
 * fp32 sums and results rounded to bf16 where the torch version rounds them. */

/* A row of `count` values (bf16 or fp32) into fp32, and back (rounded to bf16 when asked). */
static inline float rounded(float v, int is_bf16) { return is_bf16 ? round_bf16(v) : v; }

static inline float widened(const void *src, int64_t offset, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)src)[offset]) : ((const float *)src)[offset];
}

#define SUMS 32 /* independent partial sums, so the adds do not wait on each other */

static float dot_f32(const float *a, const float *b, int64_t count) {
    float part[SUMS] = {0};
    int64_t k = 0;
    for (; k + SUMS <= count; k += SUMS)
        for (int l = 0; l < SUMS; l++) part[l] += a[k + l] * b[k + l];
    float sum = 0.0f;
    for (int l = 0; l < SUMS; l++) sum += part[l];
    for (; k < count; k++) sum += a[k] * b[k];
    return sum;
}

/* 16 floats as one value (GCC/Clang vector extension); `vf_u` at any 4-byte alignment. */
typedef float vf __attribute__((vector_size(64)));
typedef float vf_u __attribute__((vector_size(64), aligned(4)));

/* The projection's products and sums as fused multiply-adds (half the vector operations; the
 * rest of this file keeps torch's separate roundings). */
#define CONTRACTED __attribute__((optimize("fp-contract=fast")))

#define OUTS 4 /* projection outputs a pass: each loaded x vector serves OUTS outputs, each fn vector 4 rows */
#define VL 16   /* floats in a vf */

/* sums[r][o] = a_r . b_o for `rows` (<= 4) rows of a (`stride` apart) and the OUTS rows b_o
 * (`ldb` apart), each sum kept as VL partial sums (lane l takes inputs k = l mod VL) added in
 * lane order, then the count % VL tail: the 4 x OUTS sums stay in registers, and every row
 * count gives a row the same sums. */
static inline __attribute__((always_inline)) CONTRACTED void dot_rows(const float *a, int64_t stride, const int rows,
                                                                     const float *b, int64_t ldb, int64_t count,
                                                                     float sums[4][OUTS]) {
    vf s[4][OUTS] = {{{0}}};
    int64_t k = 0;
    for (; k + VL <= count; k += VL) {
        vf w[OUTS];
        for (int o = 0; o < OUTS; o++) w[o] = *(const vf_u *)(b + o * ldb + k);
        for (int r = 0; r < rows; r++) {
            const vf x = *(const vf_u *)(a + r * stride + k);
            for (int o = 0; o < OUTS; o++) s[r][o] += x * w[o];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < OUTS; o++) {
            float sum = 0.0f;
            for (int l = 0; l < VL; l++) sum += s[r][o][l];
            for (int64_t i = k; i < count; i++) sum += a[r * stride + i] * b[o * ldb + i];
            sums[r][o] = sum;
        }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
/* dot_rows for one row on AVX2, the same sums: GCC lowers the 64-byte vf to pairs of AVX2
 * registers through the stack and general registers (~15 us a token here), so each VL-lane
 * sum is held as two 8-lane halves by hand and added in lane order as dot_rows adds them. */
static inline CONTRACTED void dot_row(const float *a, const float *b, int64_t ldb, int64_t count, float sums[OUTS]) {
    __m256 lo[OUTS], hi[OUTS];
    for (int o = 0; o < OUTS; o++) lo[o] = hi[o] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + VL <= count; k += VL) {
        const __m256 x_lo = _mm256_loadu_ps(a + k), x_hi = _mm256_loadu_ps(a + k + VL / 2);
        for (int o = 0; o < OUTS; o++) {
            lo[o] = _mm256_fmadd_ps(x_lo, _mm256_loadu_ps(b + o * ldb + k), lo[o]);
            hi[o] = _mm256_fmadd_ps(x_hi, _mm256_loadu_ps(b + o * ldb + k + VL / 2), hi[o]);
        }
    }
    for (int o = 0; o < OUTS; o++) {
        float lanes[VL], sum = 0.0f;
        _mm256_storeu_ps(lanes, lo[o]);
        _mm256_storeu_ps(lanes + VL / 2, hi[o]);
        for (int l = 0; l < VL; l++) sum += lanes[l];
        for (int64_t i = k; i < count; i++) sum += a[i] * b[o * ldb + i];
        sums[o] = sum;
    }
}
#define PROJECT_ROWS 1
#else
#define PROJECT_ROWS 4
#endif

/* mixed[i][j] = (x_i . fn_j) * inv_rms[i] for nt <= PROJECT_ROWS rows x_i of `flat` values (`ldx` apart) and
 * all `width` outputs, the same sums for any nt: a token's gates never depend on its block. fn
 * is padded to a multiple of OUTS rows by the caller (`fn_rows`). */
static CONTRACTED void project(const float *x, int64_t ldx, int64_t flat, int nt, const float *fn, int width,
                               const float *inv_rms, float *mixed) {
    float sums[4][OUTS];
    for (int j = 0; j < width; j += OUTS) {
        const float *b = fn + (int64_t)j * flat;
#if PROJECT_ROWS == 1
        dot_row(x, b, flat, flat, sums[0]);
#else
        switch (nt) { /* a constant row count per case: registers, not memory */
        case 1: dot_rows(x, ldx, 1, b, flat, flat, sums); break;
        case 2: dot_rows(x, ldx, 2, b, flat, flat, sums); break;
        case 3: dot_rows(x, ldx, 3, b, flat, flat, sums); break;
        default: dot_rows(x, ldx, 4, b, flat, flat, sums); break;
        }
#endif
        for (int i = 0; i < nt; i++)
            for (int o = 0; o < OUTS && j + o < width; o++) mixed[i * width + j + o] = sums[i][o] * inv_rms[i];
    }
}

/* W floats in vector registers (GCC vector extensions: AVX-512 or AVX2), bf16 loads, stores
 * and rounding as the scalar helpers above do them, lane by lane. */
#ifdef __AVX512F__
#define W 16
#else
#define W 8
#endif
typedef float v8 __attribute__((vector_size(4 * W)));
typedef uint32_t v8u __attribute__((vector_size(4 * W)));
typedef uint16_t v8h __attribute__((vector_size(2 * W)));

static inline v8 load8(const void *src, int64_t offset, int is_bf16) {
    v8 f;
    if (is_bf16) {
        v8h h;
        memcpy(&h, (const uint16_t *)src + offset, sizeof h);
        const v8u widened = __builtin_convertvector(h, v8u) << 16;
        memcpy(&f, &widened, sizeof f);
    } else {
        memcpy(&f, (const float *)src + offset, sizeof f);
    }
    return f;
}

/* f32_to_bf16 of each lane, kept in the upper half of its 32 bits (a float again). */
static inline v8u bf16_bits8(v8 x) {
    v8u u;
    memcpy(&u, &x, sizeof u);
    const v8u nearest_even = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const v8u quiet_nan = (u | 0x400000u) & 0xffff0000u;
    const v8u is_nan = (v8u)((u & 0x7fffffffu) > 0x7f800000u); /* all ones where NaN */
    return (quiet_nan & is_nan) | (nearest_even & ~is_nan);
}

static inline v8 rounded8(v8 x, int is_bf16) {
    if (!is_bf16) return x;
#ifdef __AVX512F__ /* (W == 16: a v8 is a __m512) */
    return (v8)round16((__m512)x);
#else
    const v8u bits = bf16_bits8(x);
    memcpy(&x, &bits, sizeof x);
    return x;
#endif
}

static inline void store8(v8 x, void *dst, int64_t offset, int is_bf16) {
    if (is_bf16) {
#ifdef __AVX512F__
        _mm256_storeu_si256((__m256i *)((uint16_t *)dst + offset), narrow16((__m512)x));
#else
        const v8h h = __builtin_convertvector(bf16_bits8(x) >> 16, v8h);
        memcpy((uint16_t *)dst + offset, &h, sizeof h);
#endif
    } else {
        memcpy((float *)dst + offset, &x, sizeof x);
    }
}

#define BLOCK LANES /* tokens per task: their gates are computed together, their streams stay in cache */

/* The block's input RMSNorm, as torch's RMSNorm does it: x (values of the streams' dtype)
 * normalised in fp32, rounded to that dtype, times the weight, rounded again; into out at
 * `offset` (the streams' dtype). */
static void block_norm(float *x, int64_t d, const void *weight, float eps, int is_bf16, void *out, int64_t offset) {
    const float inv = 1.0f / sqrtf(dot_f32(x, x, d) / (float)d + eps); /* partial sums: vectorised */
    if (is_bf16) {
        const uint16_t *w = weight;
        uint16_t *y = (uint16_t *)out + offset;
        int64_t c = 0;
#ifdef __AVX512F__
        for (; c + 16 <= d; c += 16) {
            const __m512 normed = round16(_mm512_mul_ps(_mm512_loadu_ps(x + c), _mm512_set1_ps(inv)));
            _mm256_storeu_si256((__m256i *)(y + c), narrow16(_mm512_mul_ps(widen16(w + c), normed)));
        }
#elif defined(__AVX2__)
        for (; c + 8 <= d; c += 8) {
            const __m256 normed = round8(_mm256_mul_ps(_mm256_loadu_ps(x + c), _mm256_set1_ps(inv)));
            _mm_storeu_si128((__m128i *)(y + c), narrow8(_mm256_mul_ps(widen8(w + c), normed)));
        }
#endif
        for (; c < d; c++) y[c] = f32_to_bf16(bf16_to_f32(w[c]) * round_bf16(x[c] * inv));
    } else {
        const float *w = weight;
        for (int64_t c = 0; c < d; c++) x[c] = w[c] * (x[c] * inv);
        narrow_row(x, d, 0, out, offset);
    }
}

/* collapse: mixed[t] = fn . x_t / rms(x_t) over the flattened streams x_t [N*D] (fn
 * [(2+N)N, N*D] fp32), the gates, then out[t] = sum_n pre[t, n] x_t[n] in the streams'
 * dtype, and with a `norm_weight` (the streams' dtype) the block's RMSNorm of it (eps
 * `block_eps`). pre [T, N], post [T, N], comb [T, N, N] fp32 as hc_gates. Tasks are blocks of
 * BLOCK tokens, each taken through all of it while its widened streams are in cache, on
 * `threads` threads. Returns 0, -1 above MAX_N, -2 without scratch memory. */
int hc_collapse(const void *streams, int is_bf16, int64_t tokens, int n, int64_t d, const float *fn,
                const float *base, const float *scale, int iters, float eps, float norm_eps,
                float *pre, float *post, float *comb, void *out, const void *norm_weight, float block_eps,
                int threads) {
    if (n > MAX_N) return -1;
    if (tokens == 0) return 0;
    if (threads < 1) threads = 1;
    const int width = (2 + n) * n;
    const int64_t flat = (int64_t)n * d, ldx = flat + 16, per_thread = BLOCK * ldx + d; /* ldx: rows off 4 KiB strides */
    const int fn_rows = (width + OUTS - 1) / OUTS * OUTS; /* project reads whole groups of OUTS rows */
    const size_t scratch_bytes = (size_t)(threads * per_thread) * sizeof(float);
    const size_t padded_bytes = fn_rows > width ? (size_t)(fn_rows * flat) * sizeof(float) : 0;
    if (scratch_reserve(scratch_padded(scratch_bytes) + scratch_padded(padded_bytes)) != 0) return -2;
    float *scratch = scratch_take(scratch_bytes);
    if (padded_bytes > 0) {
        float *padded = scratch_take(padded_bytes);
        memcpy(padded, fn, (size_t)(width * flat) * sizeof(float));
        memset(padded + width * flat, 0, (size_t)((fn_rows - width) * flat) * sizeof(float));
        fn = padded;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens > BLOCK)
    for (int64_t t0 = 0; t0 < tokens; t0 += BLOCK) {
        const int nt = tokens - t0 < BLOCK ? (int)(tokens - t0) : BLOCK;
        float *x = scratch + (int64_t)omp_get_thread_num() * per_thread, *row = x + BLOCK * ldx;
        float inv_rms[BLOCK], mixed[BLOCK * (2 + MAX_N) * MAX_N];
        for (int i = 0; i < nt; i++) {
            widen_row(streams, (t0 + i) * flat, flat, is_bf16, x + i * ldx);
            inv_rms[i] = 1.0f / sqrtf(dot_f32(x + i * ldx, x + i * ldx, flat) / (float)flat + norm_eps);
        }
        for (int i = 0; i < nt; i += PROJECT_ROWS)
            project(x + i * ldx, ldx, flat, nt - i < PROJECT_ROWS ? nt - i : PROJECT_ROWS, fn, width, inv_rms + i,
                    mixed + i * width);
        gates_block(mixed, base, scale, t0, nt, n, iters, eps, pre, post, comb);
        for (int i = 0; i < nt; i++) {
            const int64_t t = t0 + i;
            const float *xi = x + i * ldx, *w = pre + t * n;
            int64_t c = 0;
            for (; c + W <= d; c += W) { /* the sum over streams in registers */
                v8 sum = {0};
                for (int j = 0; j < n; j++) sum += w[j] * load8(xi + j * d, c, 0);
                if (norm_weight == NULL) {
                    store8(sum, out, t * d + c, is_bf16);
                } else {
                    sum = rounded8(sum, is_bf16);
                    memcpy(row + c, &sum, sizeof sum);
                }
            }
            for (; c < d; c++) {
                float sum = 0.0f;
                for (int j = 0; j < n; j++) sum += w[j] * xi[j * d + c];
                if (norm_weight == NULL) narrow_row(&sum, 1, is_bf16, out, t * d + c);
                else row[c] = rounded(sum, is_bf16);
            }
            if (norm_weight != NULL) {
                block_norm(row, d, norm_weight, block_eps, is_bf16, out, t * d);
            }
        }
    }
    scratch_done();
    return 0;
}

/* expand: out[t, i] = post[t, i] block[t] + sum_j comb[t, j, i] streams[t, j]; in bf16 the
 * gates are rounded to bf16 first and the two terms each rounded before they are added, as
 * the torch version's bf16 ops do. W columns at a time in vector registers, each output's
 * sum held in one while the N streams' columns are read: a sum kept in memory across the N
 * terms (a load and a store per term and value) made the call 4x slower at 32 tokens. */
#ifdef __AVX512F__
/* One bf16 token's columns up to vector_end (a multiple of 16): the loop below with its
 * roundings on `bf16x16.h`'s; `n` a constant where the caller names one, so that the
 * streams' vectors and the weights stay in registers. */
static inline __attribute__((always_inline)) void expand_bf16(const float *p, const float *c, const uint16_t *block,
                                                              const uint16_t *streams, const int n, int64_t d,
                                                              int64_t vector_end, uint16_t *out) {
    __m512 weight[MAX_N * MAX_N], gate[MAX_N];
    for (int i = 0; i < n; i++) gate[i] = _mm512_set1_ps(p[i]);
    for (int k = 0; k < n * n; k++) weight[k] = _mm512_set1_ps(c[k]);
    for (int64_t e = 0; e < vector_end; e += 16) {
        __m512 s[MAX_N];
        for (int j = 0; j < n; j++) s[j] = widen16(streams + j * d + e);
        const __m512 b = widen16(block + e);
        for (int i = 0; i < n; i++) {
            __m512 o = _mm512_setzero_ps();
            for (int j = 0; j < n; j++) o = _mm512_add_ps(o, _mm512_mul_ps(weight[j * n + i], s[j]));
            const __m512 sum = _mm512_add_ps(round16(_mm512_mul_ps(gate[i], b)), round16(o));
            _mm256_storeu_si256((__m256i *)(out + i * d + e), narrow16(sum));
        }
    }
}
#elif defined(__AVX2__)
/* The same on AVX2, 8 columns at a time (`bf16x8.h`'s roundings). */
static inline __attribute__((always_inline)) void expand_bf16(const float *p, const float *c, const uint16_t *block,
                                                              const uint16_t *streams, const int n, int64_t d,
                                                              int64_t vector_end, uint16_t *out) {
    __m256 weight[MAX_N * MAX_N], gate[MAX_N];
    for (int i = 0; i < n; i++) gate[i] = _mm256_set1_ps(p[i]);
    for (int k = 0; k < n * n; k++) weight[k] = _mm256_set1_ps(c[k]);
    for (int64_t e = 0; e < vector_end; e += 8) {
        __m256 s[MAX_N];
        for (int j = 0; j < n; j++) s[j] = widen8(streams + j * d + e);
        const __m256 b = widen8(block + e);
        for (int i = 0; i < n; i++) {
            __m256 o = _mm256_setzero_ps();
            for (int j = 0; j < n; j++) o = _mm256_add_ps(o, _mm256_mul_ps(weight[j * n + i], s[j]));
            const __m256 sum = _mm256_add_ps(round8(_mm256_mul_ps(gate[i], b)), round8(o));
            _mm_storeu_si128((__m128i *)(out + i * d + e), narrow8(sum));
        }
    }
}
#endif

int hc_expand(const float *post, const float *comb, const void *block, const void *streams, int is_bf16,
              int64_t tokens, int n, int64_t d, void *out, int threads) {
    if (n > MAX_N) return -1;
    if (tokens == 0) return 0;
    if (threads < 1) threads = 1;
    const int64_t vector_end = d - d % W;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens > 1)
    for (int64_t t = 0; t < tokens; t++) {
        float p[MAX_N], c[MAX_N * MAX_N]; /* c[j * n + i]: stream j's weight in output i */
        for (int i = 0; i < n; i++) p[i] = rounded(post[t * n + i], is_bf16);
        for (int k = 0; k < n * n; k++) c[k] = rounded(comb[t * n * n + k], is_bf16);
        int64_t vector_start = 0; /* columns before it are done */
#if defined(__AVX512F__) || defined(__AVX2__) /* (vector_end: a multiple of their width, W) */
        if (is_bf16) {
            const uint16_t *s = (const uint16_t *)streams + t * n * d, *b = (const uint16_t *)block + t * d;
            uint16_t *o = (uint16_t *)out + t * n * d;
            if (n == 4) expand_bf16(p, c, b, s, 4, d, vector_end, o); /* mHC's usual stream count */
            else expand_bf16(p, c, b, s, n, d, vector_end, o);
            vector_start = vector_end;
        }
#endif
        for (int64_t e = vector_start; e < vector_end; e += W) {
            v8 s[MAX_N];
            for (int j = 0; j < n; j++) s[j] = load8(streams, (t * n + j) * d + e, is_bf16);
            const v8 b = load8(block, t * d + e, is_bf16);
            for (int i = 0; i < n; i++) {
                v8 o = {0};
                for (int j = 0; j < n; j++) o += c[j * n + i] * s[j];
                store8(rounded8(p[i] * b, is_bf16) + rounded8(o, is_bf16), out, (t * n + i) * d + e, is_bf16);
            }
        }
        for (int64_t e = vector_end; e < d; e++) { /* the last d % W columns, one at a time */
            const float b = widened(block, t * d + e, is_bf16);
            for (int i = 0; i < n; i++) {
                float o = 0.0f;
                for (int j = 0; j < n; j++) o += c[j * n + i] * widened(streams, (t * n + j) * d + e, is_bf16);
                narrow_row((const float[]){rounded(p[i] * b, is_bf16) + rounded(o, is_bf16)}, 1, is_bf16, out,
                           (t * n + i) * d + e);
            }
        }
    }
    return 0;
}
