/* The sampler's row-wise work, one row per task: random sampling, then (below) the penalties.
 *
 * Random sampling replaces oxserve/engine/sampler.py's torch form, ~20 ops over the whole
 * [R, V] block with a sort for top-p and a float64 cumsum among them: 10.9 ms for 32 rows of
 * 8,192 at top-p 0.95 on a 2-core Zen 5 EPYC (`oxserve bench kernels --ops sampler.random`).
 *
 * Per row, in place: z = x / temperature; w = e^(z - max z) (0 for -inf; `vexp` floors the
 * rest at e^-87, where torch would give a denormal or 0: mass ~1e-38 a token); min-p drops w <
 * min_p (w is the probability over the most likely one's); top-k keeps the logits >= the k-th
 * largest (ties kept, as vLLM's top-k); top-p drops the smallest weights, in ascending order, while
 * their running mass stays within (1 - p) of what is left, the largest always kept; then the
 * first token whose running mass (float64, in token order) exceeds u times the total, u being
 * the row's uniform number in [0, 1). Top-k and top-p find their cut in a histogram (of the
 * logits' order, of the weights' top bits) and sort only the bin it falls in; top-p bins only
 * the weights above budget / V (the rest go whatever the others are).
 *
 * A row holding NaN or +inf, no finite logit, or a max that overflows when scaled is left
 * untouched and gets -1: the caller samples it with the torch form. */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "scratch.h"
#include "vmath.h"

/* A top-p bin: a weight's exponent and top five mantissa bits (weights lie in [0, 1]). */
#define BIN_SHIFT 18
#define BINS ((0x3f800000u >> BIN_SHIFT) + 1)

static inline uint32_t bin_of(float w) {
    union { float f; uint32_t u; } bits = {.f = w};
    return bits.u >> BIN_SHIFT;
}

#define SUMS 8 /* independent float64 partial sums: the adds overlap instead of waiting on each other */

static double sum_of(const float *w, int64_t n) {
    double partial[SUMS] = {0};
    int64_t i = 0;
    for (; i + SUMS <= n; i += SUMS)
        for (int s = 0; s < SUMS; s++) partial[s] += w[i + s];
    double total = 0.0;
    for (int s = 0; s < SUMS; s++) total += partial[s];
    for (; i < n; i++) total += w[i];
    return total;
}

/* The first index whose running sum exceeds target, or -1: blocks of SCAN summed whole until
 * the one that crosses it. */
#define SCAN 256
static int64_t first_past(const float *w, int64_t n, double target) {
    double running = 0.0;
    for (int64_t start = 0; start < n; start += SCAN) {
        const int64_t len = n - start < SCAN ? n - start : SCAN;
        const double block = sum_of(w + start, len);
        if (running + block <= target) {
            running += block;
            continue;
        }
        for (int64_t i = start; i < start + len; i++) /* (the block's own order may not cross it: go on) */
            if ((running += w[i]) > target) return i;
    }
    return -1;
}

/* A row's working memory: n floats and n indices. */
typedef struct {
    float *values;
    int32_t *index;
} RowScratch;

static int ascending(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

#define LANES 16 /* independent running maxima: the compares vectorise */

/* The row's largest logit and its first index; -1 where a logit is NaN or +inf, or none is
 * finite (division by a positive temperature keeps the order, so the scaled row's max is
 * this one's, scaled). */
static int row_max(const float *x, int64_t n, float *top, int64_t *first) {
    float lane_max[LANES];
    int32_t lane_first[LANES], bad[LANES];
    for (int l = 0; l < LANES; l++) lane_max[l] = -INFINITY, lane_first[l] = l, bad[l] = 0;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) {
            const float v = x[i + l];
            const int above = v > lane_max[l];
            lane_max[l] = above ? v : lane_max[l];
            lane_first[l] = above ? (int32_t)(i + l) : lane_first[l];
            bad[l] |= (v != v) | (v == INFINITY);
        }
    float best = -INFINITY;
    int64_t at = 0;
    int any_bad = 0;
    for (int l = 0; l < LANES; l++) {
        any_bad |= bad[l];
        if (lane_max[l] > best || (lane_max[l] == best && lane_first[l] < at)) best = lane_max[l], at = lane_first[l];
    }
    for (; i < n; i++) {
        any_bad |= (x[i] != x[i]) | (x[i] == INFINITY);
        if (x[i] > best) best = x[i], at = i;
    }
    if (any_bad || best == -INFINITY) return -1;
    *top = best;
    *first = at;
    return 0;
}

/* An unsigned key in the floats' order (-inf lowest; NaN never comes here). */
static inline uint32_t key_of(float v) {
    union { float f; uint32_t u; } bits = {.f = v};
    return bits.u & 0x80000000u ? ~bits.u : bits.u | 0x80000000u;
}

#define KEY_SHIFT 20
#define KEY_BINS (1u << (32 - KEY_SHIFT))

/* The k-th largest logit (1 <= k <= n). */
static float kth_largest(const float *x, int64_t n, int64_t k, float *bin_values) {
    static _Thread_local uint32_t counts[KEY_BINS];
    memset(counts, 0, sizeof(counts));
    for (int64_t i = 0; i < n; i++) counts[key_of(x[i]) >> KEY_SHIFT]++;
    int64_t above = 0;
    uint32_t b = KEY_BINS - 1;
    while (b > 0 && above + counts[b] < k) above += counts[b--];
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (key_of(x[i]) >> KEY_SHIFT == b) bin_values[m++] = x[i];
    qsort(bin_values, (size_t)m, sizeof(float), ascending);
    return bin_values[m - (k - above)];
}

/* Top-p over the weights left (their sum `total`): the smallest dropped, in ascending order,
 * while their mass stays within (1 - top_p) of the total. Every weight at most budget / n goes
 * first, whatever the others (together they hold at most the budget): in a trained model's
 * distribution that is most of the vocabulary, and only the rest (`index`) is binned. */
static void keep_top_p(float *w, int64_t n, double total, float top_p, int64_t most_likely, RowScratch s) {
    const double budget = (1.0 - (double)top_p) * total;
    float floor_w = (float)(budget / (double)n);
    if ((double)floor_w > budget / (double)n) floor_w = nextafterf(floor_w, 0.0f); /* rounded down: dropping stays safe */
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) { /* (no branch: which weights pass is a coin toss) */
        const int keep = w[i] > floor_w;
        s.index[m] = (int32_t)i;
        m += keep;
        w[i] = keep ? w[i] : 0.0f;
    }
    uint32_t low = BINS - 1, high = 0;
    for (int64_t j = 0; j < m; j++) {
        const uint32_t bj = bin_of(w[s.index[j]]);
        low = bj < low ? bj : low;
        high = bj > high ? bj : high;
    }
    static _Thread_local double mass[BINS];
    if (m) memset(mass + low, 0, (high - low + 1) * sizeof(double));
    double dropped = total;
    for (int64_t j = 0; j < m; j++) {
        mass[bin_of(w[s.index[j]])] += w[s.index[j]];
        dropped -= w[s.index[j]];
    }
    uint32_t b = low;
    while (b < high && dropped + mass[b] <= budget) dropped += mass[b++];
    int64_t in_bin = 0;
    for (int64_t j = 0; j < m; j++)
        if (bin_of(w[s.index[j]]) == b) s.values[in_bin++] = w[s.index[j]];
    qsort(s.values, (size_t)in_bin, sizeof(float), ascending);
    int64_t cut = 0; /* bin b's smallest `cut` values go too */
    while (cut < in_bin && dropped + s.values[cut] <= budget) dropped += s.values[cut++];
    const float last = cut ? s.values[cut - 1] : 0.0f;
    int64_t equal = 0; /* of the values dropped, how many equal the last (ties go in token order) */
    for (int64_t j = cut - 1; j >= 0 && s.values[j] == last; j--) equal++;
    for (int64_t j = 0; j < m; j++) { /* (the most likely token stays whatever the rounding: a tie with it goes instead) */
        float *wi = w + s.index[j];
        const uint32_t bi = bin_of(*wi);
        if (s.index[j] != most_likely && (bi < b || (bi == b && cut && (*wi < last || (*wi == last && equal-- > 0)))))
            *wi = 0.0f;
    }
}

/* Temperature, top-k, min-p and top-p on a row, in place: its kept weights e^(z - max z), 0
 * for the dropped. Returns their total, or -1 for a row the kernel refuses (left untouched);
 * *first_max: the most likely token. */
static double filter_row(float *row, int64_t n, float temperature, float min_p, int64_t top_k, float top_p,
                         RowScratch s, int64_t *first_max) {
    float top;
    if (!(temperature > 0.0f) || temperature == INFINITY || row_max(row, n, &top, first_max) != 0) return -1.0;
    const float top_z = top / temperature;
    if (top_z == INFINITY) return -1.0;
    /* top-k on the logits (dividing by the temperature keeps their order), before e^x rounds them */
    const float kth = top_k > 0 && top_k < n ? kth_largest(row, n, top_k, s.values) : -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        const float z = row[i] / temperature;
        row[i] = z == -INFINITY || row[i] < kth ? 0.0f : vexp(z - top_z);
    }
    if (min_p > 0.0f) /* (min-p and top-k are both masks: their order does not matter) */
        for (int64_t i = 0; i < n; i++) row[i] = row[i] < min_p ? 0.0f : row[i];
    if (top_p < 1.0f) keep_top_p(row, n, sum_of(row, n), top_p, *first_max, s);
    return sum_of(row, n);
}

/* filter_row on each row of x [rows, n] fp32 at row_stride (overwritten with the kept weights,
 * except refused rows); per row its temperature (finite, > 0; else refused), min_p, top_k (<= 0
 * or >= n: all) and top_p (in (0, 1]). With u: out [rows] int64, the first token whose running
 * mass (float64, in token order) exceeds u times the total, -1 for a refused row. With totals:
 * totals [rows] float64, -1 for a refused row. Returns 0, -1 without scratch memory, -2 for n
 * past int32. */
static int each_row(float *x, int64_t rows, int64_t n, int64_t row_stride, const float *temperature, const float *min_p,
                    const int64_t *top_k, const float *top_p, const double *u, int64_t *out, double *totals,
                    int nthreads) {
    if (nthreads < 1) nthreads = 1;
    const size_t values = scratch_padded((size_t)n * sizeof(float)), indices = scratch_padded((size_t)n * sizeof(int32_t));
    if (n > INT32_MAX) return -2;
    if (scratch_reserve((size_t)nthreads * (values + indices)) != 0) return -1;
    char *block = scratch_take((size_t)nthreads * (values + indices));
    #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        char *mine = block + (size_t)omp_get_thread_num() * (values + indices);
        float *row = x + r * row_stride;
        int64_t first_max;
        const double total = filter_row(row, n, temperature[r], min_p[r], top_k[r], top_p[r],
                                        (RowScratch){(float *)mine, (int32_t *)(mine + values)}, &first_max);
        if (totals != NULL) totals[r] = total;
        if (out != NULL) {
            const int64_t token = total < 0.0 ? -1 : first_past(row, n, u[r] * total);
            out[r] = total < 0.0 ? -1 : token >= 0 ? token : first_max; /* (u x total rounded up past a block's sum) */
        }
    }
    scratch_done();
    return 0;
}

/* Random sampling: each_row with u [rows], into out. */
int sample_rows(float *x, int64_t rows, int64_t n, int64_t row_stride, const float *temperature, const float *min_p,
                const int64_t *top_k, const float *top_p, const double *u, int64_t *out, int nthreads) {
    return each_row(x, rows, n, row_stride, temperature, min_p, top_k, top_p, u, out, NULL, nthreads);
}

/* The filters alone (speculative verification reads a draft's probability, weight / total):
 * each_row into totals. */
int filter_rows(float *x, int64_t rows, int64_t n, int64_t row_stride, const float *temperature, const float *min_p,
                const int64_t *top_k, const float *top_p, double *totals, int nthreads) {
    return each_row(x, rows, n, row_stride, temperature, min_p, top_k, top_p, NULL, NULL, totals, nthreads);
}

/* Penalties (the sampler's `apply_penalties`, the same float32 operations in the same order)
 * on the tokens a row has seen, in place: repetition on its prompt and output tokens (x / r
 * where x > 0, else x * r), then frequency times the token's output count and presence where
 * it is output at all; a finite logit stays finite (clamped to float32's range), a -inf stays
 * -inf. Tokens are given flat, each row's from its offset to the next. Scratch: each
 * vocabulary entry's output count, -1 once the entry is penalised. */

static int penalise_row(float *x, int64_t n, const int64_t *prompt, int64_t n_prompt, const int64_t *output,
                        int64_t n_output, float repetition, float frequency, float presence, int32_t *counts) {
    for (int64_t j = 0; j < n_output; j++)
        if (output[j] < 0 || output[j] >= n) return -1;
    for (int64_t j = 0; j < n_prompt; j++)
        if (prompt[j] < 0 || prompt[j] >= n) return -1;
    if (repetition == 1.0f && frequency == 0.0f && presence == 0.0f) return 0; /* (another row's penalties) */
    memset(counts, 0, (size_t)n * sizeof(int32_t));
    for (int64_t j = 0; j < n_output; j++) counts[output[j]]++;
    for (int64_t pass = 0; pass < 2; pass++) { /* each seen token once: the output's, then the prompt's */
        const int64_t *ids = pass ? prompt : output, len = pass ? n_prompt : n_output;
        for (int64_t j = 0; j < len; j++) {
            const int64_t t = ids[j];
            if (counts[t] < 0) continue; /* done already */
            const int32_t count = counts[t];
            counts[t] = -1;
            const float before = x[t];
            float v = before > 0.0f ? before / repetition : before * repetition;
            v = v - frequency * (float)count;
            v = v - presence * (count > 0 ? 1.0f : 0.0f);
            if (isfinite(before)) v = v > FLT_MAX ? FLT_MAX : (v < -FLT_MAX ? -FLT_MAX : v);
            x[t] = before == -INFINITY ? before : v; /* (a mask's -inf times a penalty rounded to 0 was NaN) */
        }
    }
    return 0;
}

/* x [rows, n] fp32 at row_stride; per row its penalties and its prompt and output tokens
 * (prompt_ids[prompt_at[r] .. prompt_at[r + 1]], likewise output). Returns 0, -1 without
 * scratch memory, -2 for a token id outside [0, n) (that row untouched, others penalised). */
int penalise_rows(float *x, int64_t rows, int64_t n, int64_t row_stride, const int64_t *prompt_ids,
                  const int64_t *prompt_at, const int64_t *output_ids, const int64_t *output_at, const float *repetition,
                  const float *frequency, const float *presence, int nthreads) {
    if (nthreads < 1) nthreads = 1;
    const size_t per_thread = scratch_padded((size_t)n * sizeof(int32_t));
    if (scratch_reserve((size_t)nthreads * per_thread) != 0) return -1;
    char *block = scratch_take((size_t)nthreads * per_thread);
    int bad = 0;
    #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (rows > 1) reduction(| : bad)
    for (int64_t r = 0; r < rows; r++)
        bad |= penalise_row(x + r * row_stride, n, prompt_ids + prompt_at[r], prompt_at[r + 1] - prompt_at[r],
                            output_ids + output_at[r], output_at[r + 1] - output_at[r], repetition[r], frequency[r],
                            presence[r], (int32_t *)(block + (size_t)omp_get_thread_num() * per_thread)) != 0;
    scratch_done();
    return bad ? -2 : 0;
}
