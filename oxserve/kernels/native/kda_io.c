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
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "scratch.h"
#include "vmath.h"

#define MAX_DIM 1024 /* head dim; NATIVE_MAX_DIM in kda_io.py */

static inline float load(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline float model_round(float x, int bf16) { return bf16 ? round_bf16(x) : x; }

static inline float sigmoid(float x) { return 1.0f / (1.0f + vexp(-x)); }

static void l2_normalise(float *x, int n, float scale) {
    const float norm = sqrtf(vdot(x, x, n) + 1e-6f); /* partial sums: a serial sum would wait on each add */
    for (int i = 0; i < n; i++) x[i] = x[i] / norm * scale;
}

/* Input `offset` (< 0: before the token's run) of request b, as values of the model dtype:
 * a mixed row, a conv-state row, or NULL for zeros (no context yet). *in_bf16 says its dtype. */
static const void *conv_source(const void *mixed, const void *state, int has_context, int64_t token, int64_t pos,
                               int64_t offset, int rows, int64_t channels, int bf16, int state_bf16, int *in_bf16) {
    if (pos + offset >= 0) {
        *in_bf16 = bf16;
        return (const char *)mixed + (token + offset) * channels * (bf16 ? 2 : 4);
    }
    *in_bf16 = state_bf16;
    return has_context ? (const char *)state + (rows + pos + offset) * channels * (state_bf16 ? 2 : 4) : NULL;
}

/* Any mix of decodes and prompt chunks: request b's tokens are rows runs[b][0] ..
 * runs[b][0] + runs[b][1] of mixed, f and beta_logits (and of q, k, v, g, beta), its conv state
 * in the table at slots[b], read as zeros unless has_context[b]. The conv reads only inputs, so
 * tokens are independent: tasks are tokens, each taking whole rows (all heads) in one pass;
 * then each request's state becomes its last K-1 inputs. Returns 0, -1 for a size above the
 * limits, -2 without scratch memory. */
int kda_conv_inputs(const void *mixed, void *conv_table, const int64_t *slots, const uint8_t *has_context,
                    const int64_t *runs, const float *conv_weight_t, const void *f, const float *dt_bias,
                    const float *a_log, const void *beta_logits, int64_t requests, int heads, int dim, int width,
                    float q_scale, int has_lower_bound, float lower_bound, int bf16, int state_bf16, float *q,
                    float *k, float *v, float *g, float *beta, int threads) {
    if (dim > MAX_DIM || width < 1) return -1;
    if (threads < 1) threads = 1;
    const int rows = width - 1;
    const int64_t hd = (int64_t)heads * dim, channels = 3 * hd, state_row = channels * (state_bf16 ? 2 : 4);
    int64_t tokens = 0;
    for (int64_t b = 0; b < requests; b++)
        if (runs[2 * b] + runs[2 * b + 1] > tokens) tokens = runs[2 * b] + runs[2 * b + 1];
    const size_t owner_bytes = (size_t)(tokens > 0 ? tokens : 1) * sizeof(int64_t);
    const size_t scratch_bytes = (size_t)(threads * 2 * channels) * sizeof(float); /* per thread: a tap, the sums */
    if (scratch_reserve(scratch_padded(owner_bytes) + scratch_padded(scratch_bytes)) != 0) return -2;
    int64_t *owner = scratch_take(owner_bytes);
    float *scratch = scratch_take(scratch_bytes);
    for (int64_t t = 0; t < tokens; t++) owner[t] = -1;
    for (int64_t b = 0; b < requests; b++)
        for (int64_t t = runs[2 * b]; t < runs[2 * b] + runs[2 * b + 1]; t++) owner[t] = b;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens > 1)
    for (int64_t token = 0; token < tokens; token++) {
        const int64_t b = owner[token];
        if (b < 0) continue; /* a row no run covers */
        const int64_t pos = token - runs[2 * b];
        float *tap = scratch + (int64_t)omp_get_thread_num() * 2 * channels, *acc = tap + channels;
        const void *state = (const char *)conv_table + slots[b] * rows * state_row;
        for (int64_t c = 0; c < channels; c++) acc[c] = 0.0f;
        for (int j = 0; j <= rows; j++) {
            int in_bf16;
            const void *src = conv_source(mixed, state, has_context[b], token, pos, j - rows, rows, channels, bf16,
                                          state_bf16, &in_bf16);
            if (src == NULL) continue; /* zeros: adding 0 * w changes no sum */
            const float *restrict w = conv_weight_t + j * channels;
            if (in_bf16) { /* widened as it is read: a widened copy first cost a store and a load a value */
                const uint16_t *restrict in = src;
                for (int64_t c = 0; c < channels; c++) acc[c] += bf16_to_f32(in[c]) * w[c];
            } else {
                const float *restrict in = src;
                for (int64_t c = 0; c < channels; c++) acc[c] += in[c] * w[c];
            }
        }
        for (int64_t c = 0; c < channels; c++) acc[c] = model_round(acc[c] * sigmoid(acc[c]), bf16);
        const int64_t row = token * hd;
        memcpy(q + row, acc, (size_t)hd * sizeof(float));
        memcpy(k + row, acc + hd, (size_t)hd * sizeof(float));
        memcpy(v + row, acc + 2 * hd, (size_t)hd * sizeof(float));
        widen_row(f, row, hd, bf16, g + row);
        for (int h = 0; h < heads; h++) {
            l2_normalise(q + row + h * dim, dim, q_scale);
            l2_normalise(k + row + h * dim, dim, 1.0f);
            const float rate = expf(a_log[h]);
            float *restrict gh = g + row + h * dim;
            for (int d = 0; d < dim; d++) gh[d] += dt_bias[h * dim + d];
            if (has_lower_bound)
                for (int d = 0; d < dim; d++) gh[d] = lower_bound * sigmoid(rate * gh[d]);
            else
                for (int d = 0; d < dim; d++) gh[d] = -rate * (gh[d] > 20.0f ? gh[d] : log1pf(expf(gh[d])));
            beta[token * heads + h] = model_round(sigmoid(load(beta_logits, token * heads + h, bf16)), bf16);
        }
    }
    /* each request's state: its last K-1 inputs (older state rows first where the run is shorter);
     * requests spread over the threads (each request its own slot; the padding rows of a
     * captured step share one, whose values nothing reads: `engine.padding`) */
#pragma omp parallel for num_threads(threads) schedule(static) if (requests > 1)
    for (int64_t b = 0; b < requests; b++) {
        const int64_t first = runs[2 * b], count = runs[2 * b + 1];
        char *state = (char *)conv_table + slots[b] * rows * state_row;
        float *tap = scratch + (int64_t)omp_get_thread_num() * 2 * channels;
        for (int j = 0; j < rows; j++) {
            if (count + j < rows) { /* an old state row, moved up: a later row, so in-place order is safe */
                if (has_context[b])
                    memmove(state + j * state_row, state + (j + count) * state_row, (size_t)state_row);
                else
                    memset(state + j * state_row, 0, (size_t)state_row);
            } else if (bf16 == state_bf16) { /* the same dtype: the input row as it is */
                memcpy(state + j * state_row, (const char *)mixed + (first + count - rows + j) * state_row,
                       (size_t)state_row);
            } else {
                widen_row(mixed, (first + count - rows + j) * channels, channels, bf16, tap);
                narrow_row(tap, channels, state_bf16, state, j * channels);
            }
        }
    }
    scratch_done();
    return 0;
}

/* Rows are widened to fp32 and narrowed back around the arithmetic, so that its loop holds no
 * dtype branch and vectorises. Returns 0, -1 for a head dim above MAX_DIM. */
int kda_gated_norm(const float *core, const void *gate, const void *weight, int64_t tokens, int heads, int dim,
                   float eps, int bf16, void *out, int threads) {
    if (dim > MAX_DIM) return -1;
    float w[MAX_DIM];
    widen_row(weight, 0, dim, bf16, w);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t th = 0; th < tokens * heads; th++) {
        float y[MAX_DIM];
        const float *x = core + th * dim;
        float sum = 0.0f;
        for (int d = 0; d < dim; d++) sum += x[d] * x[d];
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        widen_row(gate, th * dim, dim, bf16, y);
        for (int d = 0; d < dim; d++) y[d] = w[d] * (x[d] * inv) * sigmoid(y[d]);
        narrow_row(y, dim, bf16, out, th * dim);
    }
    return 0;
}

/* Requests verifying drafts: the conv state after each token of their runs, for `accept` to
 * keep the one after the last kept token. Request b (of `requests`, from `first` on among the
 * batch's runs, slots and has_context) gets windows[b][i] = its last K-1 inputs up to token
 * min(i, count - 1) of its run, in the conv table's dtype: [requests, widest, K-1, channels].
 * Read before kda_conv_inputs moves the states on. Values are copies of inputs, so converting
 * them to the table's dtype here or when kept gives the same state. */
static void copy_row(const void *src, int src_bf16, void *dst, int dst_bf16, int64_t count) {
    if (src_bf16 == dst_bf16) {
        memcpy(dst, src, (size_t)count * (src_bf16 ? 2 : 4));
        return;
    }
    float tap[1024];
    for (int64_t c0 = 0; c0 < count; c0 += 1024) {
        const int64_t n = count - c0 < 1024 ? count - c0 : 1024;
        widen_row(src, c0, n, src_bf16, tap);
        narrow_row(tap, n, dst_bf16, dst, c0);
    }
}

void kda_conv_windows(const void *mixed, const void *conv_table, const int64_t *slots, const uint8_t *has_context,
                      const int64_t *runs, int64_t first, int64_t requests, int64_t channels, int width, int64_t widest,
                      int bf16, int state_bf16, void *windows) {
    const int rows = width - 1;
    const size_t state_row = (size_t)channels * (state_bf16 ? 2 : 4), mixed_row = (size_t)channels * (bf16 ? 2 : 4);
    for (int64_t v = 0; v < requests; v++) {
        const int64_t b = first + v, start = runs[2 * b], count = runs[2 * b + 1];
        const char *state = (const char *)conv_table + slots[b] * rows * state_row;
        for (int64_t i = 0; i < widest; i++) {
            const int64_t last = i < count ? i : count - 1;
            char *window = (char *)windows + (v * widest + i) * rows * state_row;
            for (int j = 0; j < rows; j++) {
                const int64_t offset = last + 1 - rows + j; /* from the run's first token */
                char *out = window + j * state_row;
                if (offset >= 0)
                    copy_row((const char *)mixed + (start + offset) * mixed_row, bf16, out, state_bf16, channels);
                else if (has_context[b])
                    memcpy(out, state + (rows + offset) * state_row, state_row);
                else
                    memset(out, 0, state_row);
            }
        }
    }
}

/* After verifying: each request's conv state at slots[b] becomes windows[b][kept[b]]
 * ([requests, widest, K-1, channels] in the table's dtype, `window_bytes` a window). */
void kda_conv_accept(void *conv_table, const int64_t *slots, const void *windows, const int64_t *kept,
                     int64_t requests, int64_t widest, int64_t window_bytes) {
    for (int64_t b = 0; b < requests; b++)
        memcpy((char *)conv_table + slots[b] * window_bytes,
               (const char *)windows + (b * widest + kept[b]) * window_bytes, (size_t)window_bytes);
}
