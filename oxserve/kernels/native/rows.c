/* Row-wise ops of a decode step that eager torch runs as several passes, each in one pass:
 *
 *   rms_norm_bf16  y = w * bf16(x * rsqrt(mean(x^2) + eps)), x, w, y bf16, fp32 inside: the
 *                  reference RMSNorm's roundings (oxserve/kernels/norm.py), 8 eager ops;
 *   argmax_rows    the index of each fp32 row's largest value, the first one on a tie, a NaN
 *                  counting as the largest (torch's argmax/max), which torch finds with a
 *                  reduction that is not vectorised (`oxserve bench kernels --ops
 *                  sampler.greedy`, AMD EPYC of docs/performance.md, 32 rows of 8192: 229 us;
 *                  this pass 56 us);
 *   gather_rows, scatter_rows, mean_rms_norm_bf16: a decode step's embedding lookup, cache
 *                  stores and final norm, each a few eager ops (tens of microseconds each
 *                  between a decode step's large kernels) in one call;
 *   mtp_input_norms, add_rows_bf16: the MTP layer's input (a masked embedding and a hidden
 *                  state, each normed, side by side) and its residual adds of the rows wanted.
 *                  Eager, they and the embedding (now gather_rows) were the torch ops of a
 *                  captured MTP pass, and a torch op between a step's kernels runs its code
 *                  cold: at batch 1 on an AVX2 EPYC an MTP pass took ~0.6 ms in the step
 *                  against ~0.16 ms of kernels.
 *   scaled_rows_store: a step's rows into an int8/fp8 cache table (`ScaledRows.store`: ~8 eager
 *                  ops).
 *
 * The norms, argmax and scaled stores split their rows across OpenMP threads (the stores where
 * there are more than 64); the gathers and scatters copy on the calling thread. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "bf16x16.h"
#include "scaled_rows.h"

#define SCALED_CHUNK 4096 /* the widest row scaled_rows_store takes */

/* sum of x[c]^2 over a bf16 row, fp32 */
static float sum_squares(const uint16_t *x, int64_t dim) {
    float total = 0.0f;
    int64_t c = 0;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; c + 16 <= dim; c += 16) {
        const __m512 v = widen16(x + c);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    total = _mm512_reduce_add_ps(acc);
#endif
    for (; c < dim; c++) total += bf16_to_f32(x[c]) * bf16_to_f32(x[c]);
    return total;
}

static void rms_norm_row(const uint16_t *in, int64_t dim, const uint16_t *weight, float eps, uint16_t *out) {
    const float inv = 1.0f / sqrtf(sum_squares(in, dim) / (float)dim + eps);
    for (int64_t c = 0; c < dim; c++) out[c] = f32_to_bf16(bf16_to_f32(weight[c]) * round_bf16(bf16_to_f32(in[c]) * inv));
}

void rms_norm_bf16(const uint16_t *x, int64_t rows, int64_t dim, const uint16_t *weight, float eps, uint16_t *y,
                   int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) rms_norm_row(x + r * dim, dim, weight, eps, y + r * dim);
}

/* The first index of the row's largest value: a max pass, then the first index holding it;
 * a NaN anywhere makes the first NaN the answer. */
static int64_t argmax_row(const float *row, int64_t n) {
    float best = -INFINITY;
    int nan = 0;
    int64_t i = 0;
#ifdef __AVX512F__
    __m512 top = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(row + i);
        top = _mm512_max_ps(v, top); /* a NaN lane of v keeps top */
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    best = _mm512_reduce_max_ps(top);
    nan = unordered != 0;
#elif defined(__AVX2__)
    __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(row + i);
        top = _mm256_max_ps(v, top); /* a NaN lane of v keeps top */
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    for (int l = 0; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
    nan = _mm256_movemask_ps(unordered) != 0;
#endif
    for (; i < n; i++) {
        best = row[i] > best ? row[i] : best;
        nan |= row[i] != row[i];
    }
    i = 0;
#if defined(__AVX2__)
    if (!nan) { /* the first lane equal to the max, eight at a time (-0 equals +0, as C's ==) */
        const __m256 target = _mm256_set1_ps(best);
        for (; i + 8 <= n; i += 8) {
            const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), target, _CMP_EQ_OQ));
            if (hits) return i + __builtin_ctz((unsigned)hits);
        }
    }
#endif
    for (; i < n; i++)
        if (nan ? row[i] != row[i] : row[i] == best) return i;
    return 0;
}

void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t row_stride, int64_t *out, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * row_stride, n);
}

/* out[i * repeat + r] = table[ids[i]] for r < repeat: rows of row_bytes bytes, any dtype (an
 * embedding lookup, each row repeated for the hyper-connection streams). Returns -1 before
 * copying anything if an id is outside [0, table_rows), as torch's index checks would. */
int gather_rows(const char *table, int64_t table_rows, const int64_t *ids, int64_t n, int64_t row_bytes,
                int64_t repeat, char *out) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= table_rows) return -1;
    for (int64_t i = 0; i < n; i++)
        for (int64_t r = 0; r < repeat; r++) memcpy(out + (i * repeat + r) * row_bytes, table + ids[i] * row_bytes, row_bytes);
    return 0;
}

/* table[rows[i]] = values[i]: rows of row_bytes bytes, any dtype (torch's index_copy_ into a
 * cache table). Returns -1 before writing anything if a row is outside [0, table_rows). */
int scatter_rows(char *table, int64_t table_rows, const int64_t *rows, int64_t n, int64_t row_bytes, const char *values) {
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= table_rows) return -1;
    for (int64_t i = 0; i < n; i++) memcpy(table + rows[i] * row_bytes, values + i * row_bytes, row_bytes);
    return 0;
}

/* MTP's input: out[r] = [rms_norm(e_r, we, eps_e) ; rms_norm(h_r, wh, eps_h)], rows of 2 dim
 * bf16, e_r = embeds[r], or zeros where positions[r] == 0 (no token precedes position 0), h_r =
 * hidden[r]: torch's masked_fill, two RMSNorms and a cat. */
void mtp_input_norms(const uint16_t *embeds, const uint16_t *hidden, const int64_t *positions, int64_t rows, int64_t dim,
                     const uint16_t *embed_weight, float embed_eps, const uint16_t *hidden_weight, float hidden_eps,
                     uint16_t *out, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        if (positions[r] == 0) { /* rms_norm_row of a zero row: its sum of squares is 0 */
            const float inv = 1.0f / sqrtf(0.0f / (float)dim + embed_eps);
            for (int64_t c = 0; c < dim; c++)
                out[r * 2 * dim + c] = f32_to_bf16(bf16_to_f32(embed_weight[c]) * round_bf16(0.0f * inv));
        } else {
            rms_norm_row(embeds + r * dim, dim, embed_weight, embed_eps, out + r * 2 * dim);
        }
        rms_norm_row(hidden + r * dim, dim, hidden_weight, hidden_eps, out + r * 2 * dim + dim);
    }
}

/* out[i] = bf16(a[r] + b[r]) for r = ids[i] (ids NULL: r = i), rows of dim bf16: a residual add
 * of the rows wanted, as torch's bf16 add (the fp32 sum, rounded) then an index. Returns -1
 * before writing anything if an id is outside [0, rows). */
int add_rows_bf16(const uint16_t *a, const uint16_t *b, int64_t rows, const int64_t *ids, int64_t n, int64_t dim,
                  uint16_t *out) {
    for (int64_t i = 0; ids != NULL && i < n; i++)
        if (ids[i] < 0 || ids[i] >= rows) return -1;
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = ids != NULL ? ids[i] : i;
        for (int64_t c = 0; c < dim; c++)
            out[i * dim + c] = f32_to_bf16(bf16_to_f32(a[r * dim + c]) + bf16_to_f32(b[r * dim + c]));
    }
    return 0;
}

/* The final norm over the hyper-connection streams: y[i] = rms_norm_bf16(bf16(mean_s x[ids[i]][s]))
 * for x [T, streams, dim] bf16 (the mean summed in fp32 in stream order, then rounded, as
 * torch's bf16 mean). Returns -1 if an id is outside [0, T). */
int mean_rms_norm_bf16(const uint16_t *x, int64_t tokens, int64_t streams, const int64_t *ids, int64_t n, int64_t dim,
                       const uint16_t *weight, float eps, uint16_t *y) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= tokens) return -1;
    uint16_t mean[dim];
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *row = x + ids[i] * streams * dim;
        int64_t c = 0;
#ifdef __AVX512F__
        for (; c + 16 <= dim; c += 16) {
            __m512 sum = _mm512_setzero_ps();
            for (int64_t s = 0; s < streams; s++) sum = _mm512_add_ps(sum, widen16(row + s * dim + c));
            _mm256_storeu_si256((__m256i *)(mean + c), narrow16(_mm512_div_ps(sum, _mm512_set1_ps((float)streams))));
        }
#endif
        for (; c < dim; c++) {
            float sum = 0.0f;
            for (int64_t s = 0; s < streams; s++) sum += bf16_to_f32(row[s * dim + c]);
            mean[c] = f32_to_bf16(sum / (float)streams);
        }
        rms_norm_row(mean, dim, weight, eps, y + i * dim);
    }
    return 0;
}

/* Rows rows[i] of a scaled table (`kind` INT8 or FP8: `scaled_rows.h`) = x[i] (bf16 when
 * `x_bf16`, else fp32), quantized as `ScaledRows.store` quantizes them. Returns 0, -1 for a
 * row outside the table, -2 for rows wider than SCALED_CHUNK (nothing written). */
int scaled_rows_store(const void *x, int x_bf16, int64_t n, int64_t dim, const int64_t *rows, int64_t table_rows,
                      void *values, float *scales, int kind, int threads) {
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= table_rows) return -1;
    if (dim > SCALED_CHUNK) return -2;
#pragma omp parallel for num_threads(threads) schedule(static) if (n > 64) /* a prompt chunk's rows: distinct, split */
    for (int64_t i = 0; i < n; i++) {
        float row[SCALED_CHUNK];
        widen_row(x, i * dim, dim, x_bf16, row);
        quantize_row(row, dim, kind, values, scales, rows[i]);
    }
    return 0;
}
