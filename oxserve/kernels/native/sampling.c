/* Random sampling of a step's rows, one row per task (oxserve/engine/sampler.py: its torch
 * form runs ~20 ops over the whole [R, V] block, a sort for top-k/top-p and a float64 cumsum
 * among them: 2.1 ms for 32 rows of 8192 on the Zen 5 EPYC of docs/performance.md).
 *
 * Per row, in place: z = x / temperature; w = e^(z - max z) (0 for -inf); min-p drops w <
 * min_p (w is the probability over the most likely one's); top-k keeps w >= the k-th largest
 * (ties kept, as vLLM's top-k); top-p drops the smallest weights, in ascending order, while
 * their running mass stays within (1 - p) of what is left, the largest always kept; then the
 * first token whose running mass (float64, in token order) exceeds u times the total, u being
 * the row's uniform number in [0, 1). The two selections find their cut in a histogram of the
 * weights' top bits and sort only the bin it falls in.
 *
 * A row holding NaN or +inf, or no finite logit, is left untouched and gets -1: the caller
 * samples it with the torch form. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "scratch.h"
#include "vmath.h"

/* A bin: a weight's exponent and top five mantissa bits (weights lie in [0, 1]). */
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
        if (running + block > target)
            for (int64_t i = start; i < start + len; i++)
                if ((running += w[i]) > target) return i;
        running += block;
    }
    return -1;
}

static int ascending(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* z = x / temperature in place and its max; -1 (row untouched) where a z is NaN or +inf or
 * none is finite. */
static int scale_row(float *row, int64_t n, float temperature, float *max_z) {
    float top = -INFINITY;
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const float z = row[i] / temperature;
        top = z > top ? z : top;
        bad |= (z != z) | (z == INFINITY);
    }
    if (bad || top == -INFINITY) return -1;
    for (int64_t i = 0; i < n; i++) row[i] /= temperature;
    *max_z = top;
    return 0;
}

/* The k-th largest weight (1 <= k <= n). */
static float kth_largest(const float *w, int64_t n, int64_t k, float *bin_values) {
    static _Thread_local uint32_t counts[BINS];
    memset(counts, 0, sizeof(counts));
    for (int64_t i = 0; i < n; i++) counts[bin_of(w[i])]++;
    int64_t above = 0;
    uint32_t b = BINS - 1;
    while (b > 0 && above + counts[b] < k) above += counts[b--];
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (bin_of(w[i]) == b) bin_values[m++] = w[i];
    qsort(bin_values, (size_t)m, sizeof(float), ascending);
    return bin_values[m - (k - above)];
}

/* Top-p over the weights left: the smallest dropped while their mass stays within budget. */
static void keep_top_p(float *w, int64_t n, double budget, float *bin_values) {
    static _Thread_local double mass[BINS];
    memset(mass, 0, sizeof(mass));
    for (int64_t i = 0; i < n; i++) mass[bin_of(w[i])] += w[i];
    double dropped = 0.0;
    uint32_t b = 0;
    while (b < BINS - 1 && dropped + mass[b] <= budget) dropped += mass[b++];
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (bin_of(w[i]) == b) bin_values[m++] = w[i];
    qsort(bin_values, (size_t)m, sizeof(float), ascending);
    int64_t cut = 0; /* bin b's smallest `cut` values go too */
    while (cut < m && dropped + bin_values[cut] <= budget) dropped += bin_values[cut++];
    const float last = cut ? bin_values[cut - 1] : 0.0f;
    int64_t equal = 0; /* of the values dropped, how many equal the last (ties go in token order) */
    for (int64_t j = cut - 1; j >= 0 && bin_values[j] == last; j--) equal++;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t bi = bin_of(w[i]);
        if (bi < b || (bi == b && cut && (w[i] < last || (w[i] == last && equal-- > 0)))) w[i] = 0.0f;
    }
}

static int64_t sample_row(float *row, int64_t n, float temperature, float min_p, int64_t top_k, float top_p, double u,
                          float *bin_values) {
    float top;
    if (scale_row(row, n, temperature, &top) != 0) return -1;
    int64_t first_max = 0;
    while (row[first_max] != top) first_max++;
    for (int64_t i = 0; i < n; i++) row[i] = row[i] == -INFINITY ? 0.0f : vexp(row[i] - top);
    if (min_p > 0.0f)
        for (int64_t i = 0; i < n; i++) row[i] = row[i] < min_p ? 0.0f : row[i];
    if (top_k > 0 && top_k < n) {
        const float kth = kth_largest(row, n, top_k, bin_values);
        for (int64_t i = 0; i < n; i++) row[i] = row[i] < kth ? 0.0f : row[i];
    }
    if (top_p < 1.0f) {
        keep_top_p(row, n, (1.0 - (double)top_p) * sum_of(row, n), bin_values);
        row[first_max] = 1.0f; /* the most likely token always stays */
    }
    const int64_t token = first_past(row, n, u * sum_of(row, n));
    return token >= 0 ? token : first_max; /* (u times the total rounded up to a block's running sum) */
}

/* x [rows, n] fp32 at row_stride (overwritten with the kept weights, except rows that get -1);
 * per row its temperature (> 0), min_p, top_k (<= 0 or >= n: all), top_p (in (0, 1]) and
 * uniform u; out [rows] int64. Returns 0, or -1 without scratch memory. */
int sample_rows(float *x, int64_t rows, int64_t n, int64_t row_stride, const float *temperature, const float *min_p,
                const int64_t *top_k, const float *top_p, const double *u, int64_t *out, int nthreads) {
    if (nthreads < 1) nthreads = 1;
    if (scratch_reserve((size_t)nthreads * scratch_padded((size_t)n * sizeof(float))) != 0) return -1;
    float *bin_values = scratch_take((size_t)nthreads * scratch_padded((size_t)n * sizeof(float)));
    const int64_t per_thread = (int64_t)(scratch_padded((size_t)n * sizeof(float)) / sizeof(float));
    #pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1) if (rows > 1)
    for (int64_t r = 0; r < rows; r++)
        out[r] = sample_row(x + r * row_stride, n, temperature[r], min_p[r], top_k[r], top_p[r], u[r],
                            bin_values + omp_get_thread_num() * per_thread);
    scratch_done();
    return 0;
}
