/* The pointwise work around KDA's delta rule, one call each instead of ~40 eager ops a layer.
 *
 * kda_conv_inputs: the tokens of a batch of requests (decodes and prompt chunks). Per token t
 * of request b and head h, with C = 3 * H * D conv channels [q | k | v] and a conv of width K:
 *
 *   window[j][c] = the K-1 inputs before t (from slot b's conv state, oldest first, while t is
 *                  among the first K-1 tokens; zeros for a request without context), then
 *                  mixed[t][c] (all rounded to the model dtype, as torch casts the state to it)
 *   conv[c]      = silu(sum_j window[j][c] * w[c][j]), rounded to the model dtype
 *   state        = the request's last K-1 inputs                    (in place, table dtype)
 *   q = conv_q / sqrt(|conv_q|^2 + 1e-6) * q_scale    k = conv_k / sqrt(|conv_k|^2 + 1e-6)
 *   v = conv_v
 *   g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias))   (lb: the gate's lower bound)
 *     or -exp(A_log[h]) * softplus(f + dt_bias)        (no bound; softplus linear above 20)
 *   beta = sigmoid(beta_logit), rounded to the model dtype
 *
 * kda_gated_norm, per token and head: out = w * core * rsqrt(mean(core^2) + eps) * sigmoid(gate),
 * rounded to the model dtype.
 *
 * Model-dtype tensors (mixed, f, beta logits, gate, w, out) are bf16 when `bf16`, else fp32;
 * the conv state table is bf16 when `state_bf16`. q, k, v, g, beta and core are fp32. Sums are
 * fp32 in another order than torch's, so results agree within fp32 rounding (and, where a
 * value is rounded to bf16, within one bf16 step of a value on a rounding boundary).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "vmath.h"

#define MAX_DIM 1024 /* head dim; NATIVE_MAX_DIM in kda_io.py */
#define MAX_WIDTH 8 /* conv width; NATIVE_MAX_WIDTH in kda_io.py */

static inline float load(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline void store(void *base, int64_t i, float x, int bf16) {
    if (bf16)
        ((uint16_t *)base)[i] = f32_to_bf16(x);
    else
        ((float *)base)[i] = x;
}

static inline float model_round(float x, int bf16) { return bf16 ? round_bf16(x) : x; }

static inline float sigmoid(float x) { return 1.0f / (1.0f + vexp(-x)); }

/* The conv of channels [c0, c0 + n) over one request's tokens, rows first .. first + count of
 * mixed: each token's output into out (rows `ld` apart), and the request's state in the table
 * replaced by its last K-1 inputs (read as zeros where it has no context yet). weight_t
 * [K, C]: tap-major, so each tap is a contiguous run of channels. The table only ever holds
 * values of the model dtype (conv inputs), so copying them through fp32 is exact. */
static void conv_run(const void *mixed, void *table, int64_t slot, int has_context, int64_t first, int64_t count,
                     const float *weight_t, int64_t c0, int n, int64_t channels, int width, int bf16, int state_bf16,
                     float *out, int64_t ld) {
    float window[MAX_WIDTH][MAX_DIM]; /* a ring: token t's taps j = 0..K-1 are window[(t + j) % K] */
    const int rows = width - 1;
    void *state = (char *)table + slot * rows * channels * (state_bf16 ? 2 : 4);
    for (int j = 0; j < rows; j++) {
        if (has_context)
            widen_row(state, j * channels + c0, n, state_bf16, window[j]);
        else
            memset(window[j], 0, (size_t)n * sizeof(float));
    }
    for (int64_t t = 0; t < count; t++) {
        widen_row(mixed, (first + t) * channels + c0, n, bf16, window[(t + rows) % width]);
        float *restrict o = out + t * ld;
        for (int i = 0; i < n; i++) o[i] = 0.0f;
        for (int j = 0; j <= rows; j++) {
            const float *restrict w = weight_t + j * channels + c0, *restrict tap = window[(t + j) % width];
            for (int i = 0; i < n; i++) o[i] += tap[i] * w[i];
        }
        for (int i = 0; i < n; i++) o[i] = model_round(o[i] * sigmoid(o[i]), bf16);
    }
    for (int j = 0; j < rows; j++) narrow_row(window[(count + j) % width], n, state_bf16, state, j * channels + c0);
}

static void l2_normalise(float *x, int n, float scale) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) sum += x[i] * x[i];
    const float norm = sqrtf(sum + 1e-6f);
    for (int i = 0; i < n; i++) x[i] = x[i] / norm * scale;
}

/* Any mix of decodes and prompt chunks: request b's tokens are rows runs[b][0] ..
 * runs[b][0] + runs[b][1] of mixed, f and beta_logits (and of q, k, v, g, beta), its conv state
 * in the table at slots[b], read as zeros unless has_context[b]. Tasks are (request, head). */
int kda_conv_inputs(const void *mixed, void *conv_table, const int64_t *slots, const uint8_t *has_context,
                    const int64_t *runs, const float *conv_weight_t, const void *f, const float *dt_bias,
                    const float *a_log, const void *beta_logits, int64_t requests, int heads, int dim, int width,
                    float q_scale, int has_lower_bound, float lower_bound, int bf16, int state_bf16, float *q,
                    float *k, float *v, float *g, float *beta, int threads) {
    if (dim > MAX_DIM || width > MAX_WIDTH || width < 1) return -1;
    const int64_t hd = (int64_t)heads * dim, channels = 3 * hd;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t bh = 0; bh < requests * heads; bh++) {
        const int64_t b = bh / heads, h = bh % heads, first = runs[2 * b], count = runs[2 * b + 1];
        const int64_t at = first * hd + h * dim;
        float *outs[3] = {q + at, k + at, v + at};
        for (int part = 0; part < 3; part++)
            conv_run(mixed, conv_table, slots[b], has_context[b], first, count, conv_weight_t, part * hd + h * dim, dim,
                     channels, width, bf16, state_bf16, outs[part], hd);
        const float rate = expf(a_log[h]);
        for (int64_t t = first; t < first + count; t++) {
            const int64_t row = t * hd + h * dim;
            l2_normalise(q + row, dim, q_scale);
            l2_normalise(k + row, dim, 1.0f);
            float *restrict gh = g + row;
            widen_row(f, row, dim, bf16, gh);
            for (int d = 0; d < dim; d++) gh[d] += dt_bias[h * dim + d];
            if (has_lower_bound)
                for (int d = 0; d < dim; d++) gh[d] = lower_bound * sigmoid(rate * gh[d]);
            else
                for (int d = 0; d < dim; d++) gh[d] = -rate * (gh[d] > 20.0f ? gh[d] : log1pf(expf(gh[d])));
            beta[t * heads + h] = model_round(sigmoid(load(beta_logits, t * heads + h, bf16)), bf16);
        }
    }
    return 0;
}

int kda_gated_norm(const float *core, const void *gate, const void *weight, int64_t tokens, int heads, int dim,
                   float eps, int bf16, void *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t th = 0; th < tokens * heads; th++) {
        const float *x = core + th * dim;
        float sum = 0.0f;
        for (int d = 0; d < dim; d++) sum += x[d] * x[d];
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int d = 0; d < dim; d++) {
            const float y = load(weight, d, bf16) * (x[d] * inv) * sigmoid(load(gate, th * dim + d, bf16));
            store(out, th * dim + d, y, bf16);
        }
    }
    return 0;
}
