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
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

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

/* Returns 0, or -1 when n is above MAX_N (the caller then uses the torch version). */
int hc_gates(const float *mixed, const float *base, const float *scale, int64_t tokens, int n,
             int iters, float eps, float *pre, float *post, float *comb) {
    if (n > MAX_N) return -1;
    const int width = (2 + n) * n, nn = n * n;
    float block[MAX_N * MAX_N][LANES];
    for (int64_t t = 0; t < tokens; t++) {
        const float *x = mixed + t * width;
        for (int j = 0; j < n; j++) {
            pre[t * n + j] = sigmoidf(x[j] * scale[0] + base[j]) + eps;
            post[t * n + j] = 2.0f * sigmoidf(x[n + j] * scale[1] + base[n + j]);
        }
    }
    for (int64_t t0 = 0; t0 < tokens; t0 += LANES) {
        int lanes = tokens - t0 < LANES ? (int)(tokens - t0) : LANES;
        for (int k = 0; k < nn; k++)
            for (int l = 0; l < LANES; l++)  /* idle lanes repeat the block's first token */
                block[k][l] = mixed[(t0 + (l < lanes ? l : 0)) * width + 2 * n + k] * scale[2] + base[2 * n + k];
        row_softmax(block, n, eps);
        normalise(block, n, 0, eps);
        for (int it = 1; it < iters; it++) {
            normalise(block, n, 1, eps);
            normalise(block, n, 0, eps);
        }
        for (int l = 0; l < lanes; l++)
            for (int k = 0; k < nn; k++) comb[(t0 + l) * nn + k] = block[k][l];
    }
    return 0;
}

/* ---- the whole collapse and expand, for decode-sized batches -------------------------------
 *
 * Streams are [T, N, D] in bf16 (is_bf16) or fp32; the torch version is ~10 eager ops per
 * call (dtype copies, a norm, a skinny product, two batched products), each costing more
 * than a decode step's few tokens of arithmetic. Same operations as `HyperConnection`, with
 * fp32 sums and results rounded to bf16 where the torch version rounds them. */

/* A row of `count` values (bf16 or fp32) into fp32, and back (rounded to bf16 when asked). */
static void widen_row(const void *src, int64_t offset, int64_t count, int is_bf16, float *dst) {
    if (is_bf16) {
        const uint16_t *p = (const uint16_t *)src + offset;
        for (int64_t k = 0; k < count; k++) dst[k] = bf16_to_f32(p[k]);
    } else {
        const float *p = (const float *)src + offset;
        for (int64_t k = 0; k < count; k++) dst[k] = p[k];
    }
}

static void narrow_row(const float *src, int64_t count, int is_bf16, void *dst, int64_t offset) {
    if (is_bf16) {
        uint16_t *p = (uint16_t *)dst + offset;
        for (int64_t k = 0; k < count; k++) p[k] = f32_to_bf16(src[k]);
    } else {
        float *p = (float *)dst + offset;
        for (int64_t k = 0; k < count; k++) p[k] = src[k];
    }
}

static inline float rounded(float v, int is_bf16) { return is_bf16 ? round_bf16(v) : v; }

#define SUMS 64 /* independent partial sums: four vector registers, so the adds do not wait on each other */

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

/* collapse: mixed[t] = fn . x_t / rms(x_t) over the flattened streams x_t [N*D] (fn
 * [(2+N)N, N*D] fp32), the gates, then out[t] = sum_n pre[t, n] x_t[n] in the streams'
 * dtype. pre [T, N], post [T, N], comb [T, N, N] fp32 as hc_gates. Returns 0, -1 above
 * MAX_N, -2 without scratch memory. */
int hc_collapse(const void *streams, int is_bf16, int64_t tokens, int n, int64_t d, const float *fn,
                const float *base, const float *scale, int iters, float eps, float norm_eps,
                float *pre, float *post, float *comb, void *out) {
    if (n > MAX_N) return -1;
    if (tokens == 0) return 0;
    const int width = (2 + n) * n;
    const int64_t flat = (int64_t)n * d;
    float *mixed = malloc((size_t)(tokens * width) * sizeof(float));
    float *x = malloc((size_t)(tokens * flat) * sizeof(float));
    float *row = malloc((size_t)d * sizeof(float));
    if (mixed == NULL || x == NULL || row == NULL) { free(mixed); free(x); free(row); return -2; }
    widen_row(streams, 0, tokens * flat, is_bf16, x);
    for (int64_t t = 0; t < tokens; t++) {
        const float *xt = x + t * flat;
        float inv_rms = 1.0f / sqrtf(dot_f32(xt, xt, flat) / (float)flat + norm_eps);
        for (int j = 0; j < width; j++) mixed[t * width + j] = dot_f32(xt, fn + j * flat, flat) * inv_rms;
    }
    hc_gates(mixed, base, scale, tokens, n, iters, eps, pre, post, comb);
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t c = 0; c < d; c++) row[c] = 0.0f;
        for (int j = 0; j < n; j++) {
            const float *xj = x + t * flat + j * d, w = pre[t * n + j];
            for (int64_t c = 0; c < d; c++) row[c] += w * xj[c];
        }
        narrow_row(row, d, is_bf16, out, t * d);
    }
    free(mixed);
    free(x);
    free(row);
    return 0;
}

/* expand: out[t, i] = post[t, i] block[t] + sum_j comb[t, j, i] streams[t, j]; in bf16 the
 * gates are rounded to bf16 first and the two terms each rounded before they are added, as
 * the torch version's bf16 ops do. Returns 0, or -2 without scratch memory. */
int hc_expand(const float *post, const float *comb, const void *block, const void *streams, int is_bf16,
              int64_t tokens, int n, int64_t d, void *out) {
    if (n > MAX_N) return -1;
    if (tokens == 0) return 0;
    float *scratch = malloc((size_t)((n + 2) * d) * sizeof(float));
    if (scratch == NULL) return -2;
    float *s = scratch, *b = scratch + n * d, *o = scratch + (n + 1) * d;
    for (int64_t t = 0; t < tokens; t++) {
        widen_row(streams, t * n * d, n * d, is_bf16, s);
        widen_row(block, t * d, d, is_bf16, b);
        for (int i = 0; i < n; i++) {
            float p = rounded(post[t * n + i], is_bf16);
            for (int64_t e = 0; e < d; e++) o[e] = 0.0f;
            for (int j = 0; j < n; j++) {
                const float c = rounded(comb[(t * n + j) * n + i], is_bf16), *sj = s + j * d;
                for (int64_t e = 0; e < d; e++) o[e] += c * sj[e];
            }
            for (int64_t e = 0; e < d; e++) o[e] = rounded(p * b[e], is_bf16) + rounded(o[e], is_bf16);
            narrow_row(o, d, is_bf16, out, (t * n + i) * d);
        }
    }
    free(scratch);
    return 0;
}
