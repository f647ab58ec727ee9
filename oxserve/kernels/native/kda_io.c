/* The pointwise work around a KDA decode step, one call each instead of ~40 eager ops a layer.
 *
 * kda_decode_inputs: one token for each of `batch` requests. Per request b and head h, with
 * C = 3 * H * D conv channels [q | k | v] and a conv of width K:
 *
 *   window[j][c] = conv state row j of slot b (j < K-1, oldest first), then mixed[b][c]
 *                  (both rounded to the model dtype, as torch casts the state to it)
 *   conv[c]      = silu(sum_j window[j][c] * w[c][j]), rounded to the model dtype
 *   state[j][c]  = window[j+1][c]                                   (in place, table dtype)
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

/* The conv of channels [c0, c0 + n) of request b into out[0..n), and its state shifted in
 * place. weight_t [K, C]: tap-major, so each tap is a contiguous run of channels. The table
 * only ever holds values of the model dtype (conv inputs), so shifting its rows as they are
 * equals rounding them to the model dtype first. */
static void conv_channels(const void *mixed, void *table, int64_t slot, int64_t b, const float *weight_t, int64_t c0,
                          int n, int64_t channels, int width, int bf16, int state_bf16, float *restrict out) {
    float tap[MAX_DIM];
    const int64_t rows = width - 1, elem = state_bf16 ? 2 : 4;
    char *state = (char *)table + slot * rows * channels * elem;
    for (int i = 0; i < n; i++) out[i] = 0.0f;
    for (int64_t j = 0; j <= rows; j++) {
        if (j < rows)
            widen_row(state, j * channels + c0, n, state_bf16, tap);
        else
            widen_row(mixed, b * channels + c0, n, bf16, tap);
        const float *restrict w = weight_t + j * channels + c0;
        for (int i = 0; i < n; i++) out[i] += tap[i] * w[i];
    }
    for (int64_t j = 0; j + 1 < rows; j++)
        memmove(state + (j * channels + c0) * elem, state + ((j + 1) * channels + c0) * elem, (size_t)n * elem);
    if (rows > 0) narrow_row(tap, n, state_bf16, state, (rows - 1) * channels + c0);  /* tap: the input */
    for (int i = 0; i < n; i++) out[i] = model_round(out[i] * sigmoid(out[i]), bf16);
}

static void l2_normalise(float *x, int n, float scale) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) sum += x[i] * x[i];
    const float norm = sqrtf(sum + 1e-6f);
    for (int i = 0; i < n; i++) x[i] = x[i] / norm * scale;
}

int kda_decode_inputs(const void *mixed, void *conv_table, const int64_t *slots, const float *conv_weight_t,
                      const void *f, const float *dt_bias, const float *a_log, const void *beta_logits,
                      int64_t batch, int heads, int dim, int width, float q_scale, int has_lower_bound,
                      float lower_bound, int bf16, int state_bf16, float *q, float *k, float *v, float *g, float *beta,
                      int threads) {
    if (dim > MAX_DIM) return -1;
    const int64_t hd = (int64_t)heads * dim, channels = 3 * hd;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t bh = 0; bh < batch * heads; bh++) {
        const int64_t b = bh / heads, h = bh % heads, at = b * hd + h * dim;
        conv_channels(mixed, conv_table, slots[b], b, conv_weight_t, h * dim, dim, channels, width, bf16, state_bf16, q + at);
        conv_channels(mixed, conv_table, slots[b], b, conv_weight_t, hd + h * dim, dim, channels, width, bf16, state_bf16,
                      k + at);
        conv_channels(mixed, conv_table, slots[b], b, conv_weight_t, 2 * hd + h * dim, dim, channels, width, bf16,
                      state_bf16, v + at);
        l2_normalise(q + at, dim, q_scale);
        l2_normalise(k + at, dim, 1.0f);
        const float rate = expf(a_log[h]);
        float *restrict gh = g + at;
        widen_row(f, at, dim, bf16, gh);
        for (int d = 0; d < dim; d++) gh[d] += dt_bias[h * dim + d];
        if (has_lower_bound)
            for (int d = 0; d < dim; d++) gh[d] = lower_bound * sigmoid(rate * gh[d]);
        else
            for (int d = 0; d < dim; d++) gh[d] = -rate * (gh[d] > 20.0f ? gh[d] : log1pf(expf(gh[d])));
        beta[bh] = model_round(sigmoid(load(beta_logits, bh, bf16)), bf16);
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
