/* The MoE router for a batch of tokens in one call (torch runs it as ~12 small ops):
 *
 *   score[e]  = sigmoid(x . W[e])                      fp32 (x widened from bf16 if `bf16`)
 *   choice[e] = score[e] + bias[e]
 *   groups    (n_group > 1): a group's score is the sum of its two best choices; the choices
 *             outside the topk_group best groups become -inf
 *   ids       = the top_k experts by choice (best first; ties: the lower id)
 *   weights   = score[ids], divided by their sum (+1e-20) when `normalise`, times `scaling`
 *
 * Tokens are spread over `threads` threads. Returns 0, or -1 above MAX_EXPERTS.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "vmath.h"

#define MAX_EXPERTS 1024

/* The index of the largest value among `n` with eligible[i] (ties: the lowest index), or -1. */
static int64_t best(const float *value, const uint8_t *eligible, int64_t n) {
    int64_t at = -1;
    for (int64_t i = 0; i < n; i++)
        if (eligible[i] && (at < 0 || value[i] > value[at])) at = i;
    return at;
}

int moe_route(const void *x, int bf16, int64_t tokens, int64_t hidden, const float *weight, const float *bias,
              int64_t experts, int64_t n_group, int64_t topk_group, int64_t top_k, int normalise, float scaling,
              int64_t *ids, float *weights, float *row_scratch, int threads) {
    if (experts > MAX_EXPERTS || n_group < 1 || experts % n_group != 0) return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens > 1)
    for (int64_t t = 0; t < tokens; t++) {
        float score[MAX_EXPERTS], choice[MAX_EXPERTS];
        uint8_t eligible[MAX_EXPERTS];
        const float *row;
        if (bf16) {
            float *wide = row_scratch + t * hidden;
            const uint16_t *src = (const uint16_t *)x + t * hidden;
            for (int64_t c = 0; c < hidden; c++) wide[c] = bf16_to_f32(src[c]);
            row = wide;
        } else {
            row = (const float *)x + t * hidden;
        }
        for (int64_t e = 0; e < experts; e++) {
            score[e] = 1.0f / (1.0f + expf(-vdot(row, weight + e * hidden, hidden)));
            choice[e] = score[e] + bias[e];
            eligible[e] = 1;
        }
        if (n_group > 1) {
            const int64_t size = experts / n_group;
            float group[MAX_EXPERTS];
            uint8_t open[MAX_EXPERTS], keep[MAX_EXPERTS] = {0};
            for (int64_t g = 0; g < n_group; g++) {
                const int64_t a = best(choice + g * size, eligible + g * size, size);
                eligible[g * size + a] = 0;
                const int64_t b = size > 1 ? best(choice + g * size, eligible + g * size, size) : -1;
                eligible[g * size + a] = 1;
                group[g] = choice[g * size + a] + (b >= 0 ? choice[g * size + b] : 0.0f);
                open[g] = 1;
            }
            for (int64_t n = 0; n < topk_group && n < n_group; n++) {
                const int64_t g = best(group, open, n_group);
                keep[g] = 1;
                open[g] = 0;
            }
            for (int64_t e = 0; e < experts; e++)
                if (!keep[e / size]) choice[e] = -INFINITY; /* as torch masks them: still last resorts */
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < top_k; j++) {
            const int64_t e = best(choice, eligible, experts);
            eligible[e] = 0;
            ids[t * top_k + j] = e;
            weights[t * top_k + j] = score[e];
            sum += score[e];
        }
        for (int64_t j = 0; j < top_k; j++) {
            float w = weights[t * top_k + j];
            if (normalise) w = w / (sum + 1e-20f);
            weights[t * top_k + j] = w * scaling;
        }
    }
    return 0;
}
