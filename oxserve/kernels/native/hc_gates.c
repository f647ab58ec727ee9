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
