/* KDA decode: one token for each of a batch of requests, on the cache's state table in
 * place (no gathered copy, no scattered write-back of a copy). Two ways to keep the state:
 *
 * write-back: S <- diag(a) S + k d^T with a = exp(g), d = beta (v - (k*a)^T S); o = q^T S.
 *   One pass reads S for both (q*a)^T S and (k*a)^T S, since q^T S_new = (q*a)^T S + (q.k) d;
 *   a second pass writes S_new.
 * replay (ReplaySSM): S stays the checkpoint S0 of the request's last fold; a ring keeps, per
 *   step j since then, the key, the cumulative log-decay G_j from S0, and the update d_j.
 *   With A = exp(G_t) and the ring's keys decayed to step t, w_j = k_j * exp(G_t - G_j),
 *       (k_t)^T S_{t-1} decayed = (k_t*A)^T S0 + sum_j (k_t . w_j) d_j
 *       o_t                     = (q_t*A)^T S0 + sum_j (q_t . w_j) d_j + (q_t . k_t) d_t
 *   so a step reads S0 once and writes only its ring entry. A full ring is folded first:
 *       S0 <- diag(exp(G_n)) S0 + sum_j (k_j * exp(G_n - G_j)) d_j^T       (exact, one pass)
 *   Stored keys: `exact` = 0 keeps k_j * exp(-G_j), so w_j = A * key_j needs no exp per
 *   entry (valid while |G| stays a normal fp32 exponent: the caller checks the gate's bound);
 *   `exact` = 1 keeps k_j and forms exp(G_t - G_j) for any decay.
 *
 * Layouts (fp32, contiguous): q, k, g [B, H, Dk]; v [B, H, Dv]; beta [B, H]; out [B, H, Dv];
 * states [slots, H, Dk, Dv]; ring keys and log-decays [slots, H, R, Dk], deltas [slots, H, R, Dv]
 * (a request's head's entries side by side: a step streams them);
 * slots [B]; counts [B]: ring entries before this step (R: fold first). The host keeps counts.
 *
 * The state table may be bf16 (`is_bf16`; the rings stay fp32): computed in fp32 and rounded
 * back only where the torch version rounds (a write-back step's or run's new state, a fold's
 * checkpoint): half the table's bytes a step, the same recurrence in fp32. Where the AVX-512
 * passes can (dv % 16 == 0) a write-back step, and a replay step reading its checkpoint, widen
 * and round the table's own values as they go; elsewhere (prompt runs, folds, other widths) a
 * task works on a widened copy in its thread's scratch. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "bf16x16.h"
#include "scratch.h"

#define MAX_D 256

/* The states of a call's tasks as fp32: an fp32 table's own, or for a bf16 table a copy
 * widened into the calling thread's piece of scratch (`Copies` made before the parallel
 * region; each thread uses its own piece). */
typedef struct {
    void *table;
    int is_bf16;
    int64_t size; /* floats a state: heads' states are `size` apart, in slot-major order */
    float *scratch;
} States;

/* 0, or -3 without scratch memory for `threads` copies. */
static int states_open(States *s, void *table, int is_bf16, int dk, int dv, int threads) {
    s->table = table, s->is_bf16 = is_bf16, s->size = (int64_t)dk * dv, s->scratch = 0;
    if (!is_bf16) return 0;
    const size_t bytes = (size_t)(threads > 1 ? threads : 1) * (size_t)s->size * sizeof(float);
    if (scratch_reserve(scratch_padded(bytes)) != 0) return -3;
    s->scratch = scratch_take(bytes);
    return 0;
}

static float *state_own(const States *s) { return s->scratch + (int64_t)omp_get_thread_num() * s->size; }

/* State `index` (slot * heads + head) as fp32 for the calling thread. */
static float *state_get(const States *s, int64_t index) {
    if (!s->is_bf16) return (float *)s->table + index * s->size;
    float *own = state_own(s);
    widen_row(s->table, index * s->size, s->size, 1, own);
    return own;
}

/* The same, all zeros (a request with no context yet). */
static float *state_zero(const States *s, int64_t index) {
    float *S = s->is_bf16 ? state_own(s) : (float *)s->table + index * s->size;
    for (int64_t i = 0; i < s->size; i++) S[i] = 0.0f;
    return S;
}

/* The table's state `index` from its fp32 copy S (a no-op on an fp32 table: S is it). */
static void state_put(const States *s, int64_t index, const float *S) {
    if (s->is_bf16) narrow_row(S, s->size, 1, s->table, index * s->size);
}

typedef struct {
    float *keys, *decays, *deltas;
    int len, heads, dk, dv, exact;
} Ring;

static inline float *entry(const Ring *r, float *base, int64_t slot, int j, int h, int width) {
    return base + ((slot * r->heads + h) * r->len + j) * (int64_t)width;
}

/* S0 <- fold of the first n ring entries of (slot, h). */
static void fold(float *restrict S, const Ring *r, int64_t slot, int h, int n) {
    const int dk = r->dk, dv = r->dv;
    const float *last = entry(r, r->decays, slot, n - 1, h, dk);
    for (int d = 0; d < dk; d++) {
        const float scale = expf(last[d]);
        float *restrict row = S + (int64_t)d * dv;
        for (int e = 0; e < dv; e++) row[e] *= scale;
        for (int j = 0; j < n; j++) {
            const float key = entry(r, r->keys, slot, j, h, dk)[d];
            const float w = r->exact ? key * expf(last[d] - entry(r, r->decays, slot, j, h, dk)[d]) : key * scale;
            const float *restrict delta = entry(r, r->deltas, slot, j, h, dv);
            for (int e = 0; e < dv; e++) row[e] += w * delta[e];
        }
    }
}

/* p = x^T S and r = y^T S in one pass over S [dk, dv]. */
static void two_products(const float *restrict S, const float *x, const float *y, int dk, int dv, float *restrict p,
                         float *restrict r) {
    for (int e = 0; e < dv; e++) p[e] = r[e] = 0.0f;
    for (int d = 0; d < dk; d++) {
        const float *restrict row = S + (int64_t)d * dv;
        const float xd = x[d], yd = y[d];
        for (int e = 0; e < dv; e++) {
            p[e] += xd * row[e];
            r[e] += yd * row[e];
        }
    }
}

/* Eight partial sums, so that the loop vectorises without reordering licence (no fast-math). */
static float dot(const float *restrict a, const float *restrict b, int n) {
    float lanes[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) lanes[l] += a[i + l] * b[i + l];
    float s = 0.0f;
    for (; i < n; i++) s += a[i] * b[i];
    for (int l = 0; l < 8; l++) s += lanes[l];
    return s;
}

/* (a . c, b . c) in one pass over c. */
static void dot2(const float *restrict a, const float *restrict b, const float *restrict c, int n, float *ac, float *bc) {
    float la[8] = {0}, lb[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) {
            la[l] += a[i + l] * c[i + l];
            lb[l] += b[i + l] * c[i + l];
        }
    float sa = 0.0f, sb = 0.0f;
    for (; i < n; i++) {
        sa += a[i] * c[i];
        sb += b[i] * c[i];
    }
    for (int l = 0; l < 8; l++) {
        sa += la[l];
        sb += lb[l];
    }
    *ac = sa;
    *bc = sb;
}

int kda_decode_max_dim(void) { return MAX_D; }

/* x = q * a, y = k * a for one token of one head, a its decay. */
static void decay_inputs(const float *qh, const float *kh, const float *a, int dk, float *x, float *y) {
    for (int d = 0; d < dk; d++) {
        x[d] = qh[d] * a[d];
        y[d] = kh[d] * a[d];
    }
}

/* The update d = beta (v - r) and o = p + (q . k) d, from p = (q*a)^T S and r = (k*a)^T S. */
static void delta_and_output(const float *qh, const float *kh, const float *vh, float beta, const float *p,
                             const float *r, int dk, int dv, float *restrict delta, float *restrict o) {
    const float qk = dot(qh, kh, dk);
    for (int e = 0; e < dv; e++) {
        delta[e] = beta * (vh[e] - r[e]);
        o[e] = p[e] + qk * delta[e];
    }
}

#ifdef __AVX512F__
/* A decode step's two passes over one head's state S [dk, dv] for dv % 16 == 0, reading and
 * writing the table's own values, bf16 or fp32 (`is_bf16` a constant where the caller names
 * one): a bf16 state is widened as it is read and rounded as it is stored, with no copy and
 * no pass of its own (a widened copy made the step 1.9x slower at 32 requests). */
static inline __attribute__((always_inline)) __m512 state16(const void *S, int64_t i, const int is_bf16) {
    return is_bf16 ? widen16((const uint16_t *)S + i) : _mm512_loadu_ps((const float *)S + i);
}

static inline __attribute__((always_inline)) void store_state16(void *S, int64_t i, __m512 v, const int is_bf16) {
    if (is_bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)S + i), narrow16(v));
    else _mm512_storeu_ps((float *)S + i, v);
}

/* p = x^T S and r = y^T S, 64 columns (4 vectors) a pass over the rows, then 16. */
static inline __attribute__((always_inline)) void products16(const void *S, const int is_bf16, const float *x,
                                                             const float *y, int dk, int dv, float *p, float *r) {
    int e0 = 0;
    for (; e0 + 64 <= dv; e0 += 64) {
        __m512 pv[4], rv[4];
        for (int j = 0; j < 4; j++) pv[j] = rv[j] = _mm512_setzero_ps();
        for (int d = 0; d < dk; d++) {
            const __m512 xd = _mm512_set1_ps(x[d]), yd = _mm512_set1_ps(y[d]);
            for (int j = 0; j < 4; j++) {
                const __m512 s = state16(S, (int64_t)d * dv + e0 + 16 * j, is_bf16);
                pv[j] = _mm512_fmadd_ps(xd, s, pv[j]);
                rv[j] = _mm512_fmadd_ps(yd, s, rv[j]);
            }
        }
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(p + e0 + 16 * j, pv[j]), _mm512_storeu_ps(r + e0 + 16 * j, rv[j]);
    }
    for (; e0 < dv; e0 += 16) {
        __m512 pv = _mm512_setzero_ps(), rv = pv;
        for (int d = 0; d < dk; d++) {
            const __m512 s = state16(S, (int64_t)d * dv + e0, is_bf16);
            pv = _mm512_fmadd_ps(_mm512_set1_ps(x[d]), s, pv);
            rv = _mm512_fmadd_ps(_mm512_set1_ps(y[d]), s, rv);
        }
        _mm512_storeu_ps(p + e0, pv), _mm512_storeu_ps(r + e0, rv);
    }
}

/* S <- diag(a) S + k delta^T. */
static inline __attribute__((always_inline)) void update16(void *S, const int is_bf16, const float *a, const float *k,
                                                           const float *delta, int dk, int dv) {
    for (int d = 0; d < dk; d++) {
        const __m512 ad = _mm512_set1_ps(a[d]), kd = _mm512_set1_ps(k[d]);
        for (int e = 0; e < dv; e += 16) {
            const int64_t i = (int64_t)d * dv + e;
            const __m512 s = _mm512_fmadd_ps(ad, state16(S, i, is_bf16), _mm512_mul_ps(kd, _mm512_loadu_ps(delta + e)));
            store_state16(S, i, s, is_bf16);
        }
    }
}

/* kda_writeback_step for dv % 16 == 0: each head's state read and written in the table. */
static inline __attribute__((always_inline)) void writeback_step16(
    const float *q, const float *k, const float *v, const float *g, const float *beta, void *states,
    const int64_t *slots, int64_t batch, int heads, int dk, int dv, const int is_bf16, float *out, int threads) {
    const int64_t elem = is_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t bh = 0; bh < batch * heads; bh++) {
        const int64_t b = bh / heads;
        void *S = (char *)states + (slots[b] * heads + bh % heads) * (int64_t)dk * dv * elem;
        const float *kh = k + bh * dk;
        float a[MAX_D], x[MAX_D], y[MAX_D], p[MAX_D], r[MAX_D], delta[MAX_D];
        for (int d = 0; d < dk; d++) a[d] = expf(g[bh * dk + d]);
        decay_inputs(q + bh * dk, kh, a, dk, x, y);
        products16(S, is_bf16, x, y, dk, dv, p, r);
        delta_and_output(q + bh * dk, kh, v + bh * dv, beta[bh], p, r, dk, dv, delta, out + bh * dv);
        update16(S, is_bf16, a, kh, delta, dk, dv);
    }
}
#endif

/* Returns 0, -1 for head dims above MAX_D, -3 without scratch (bf16 tables). */
int kda_writeback_step(const float *q, const float *k, const float *v, const float *g, const float *beta,
                       void *states, const int64_t *slots, int64_t batch, int heads, int dk, int dv, int is_bf16,
                       float *out, int threads) {
    if (dk > MAX_D || dv > MAX_D) return -1;
#ifdef __AVX512F__
    if (dv % 16 == 0) {
        if (is_bf16) writeback_step16(q, k, v, g, beta, states, slots, batch, heads, dk, dv, 1, out, threads);
        else writeback_step16(q, k, v, g, beta, states, slots, batch, heads, dk, dv, 0, out, threads);
        return 0;
    }
#endif
    States table;
    if (states_open(&table, states, is_bf16, dk, dv, threads) != 0) return -3;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t bh = 0; bh < batch * heads; bh++) {
        const int64_t b = bh / heads, index = slots[b] * heads + bh % heads;
        float *S = state_get(&table, index);
        const float *kh = k + bh * dk;
        float a[MAX_D], x[MAX_D], y[MAX_D], p[MAX_D], r[MAX_D], delta[MAX_D];
        for (int d = 0; d < dk; d++) a[d] = expf(g[bh * dk + d]);
        decay_inputs(q + bh * dk, kh, a, dk, x, y);
        two_products(S, x, y, dk, dv, p, r);
        delta_and_output(q + bh * dk, kh, v + bh * dv, beta[bh], p, r, dk, dv, delta, out + bh * dv);
        for (int d = 0; d < dk; d++) {
            float *restrict row = S + (int64_t)d * dv;
            for (int e = 0; e < dv; e++) row[e] = a[d] * row[e] + kh[d] * delta[e];
        }
        state_put(&table, index, S);
    }
    return 0;
}

/* 16 floats as one value (GCC/Clang vector extension: AVX-512 registers where the CPU has
 * them, else pairs of narrower ones); `vf_u` loads and stores them at any 4-byte alignment. */
typedef float vf __attribute__((vector_size(64)));
typedef float vf_u __attribute__((vector_size(64), aligned(4)));
#define VL 16

/* S <- diag(a) S + k delta^T, and p = x^T S, r = y^T S of the new S, in one pass over S. The
 * sums of 32 columns stay in registers through all dk rows (two sets, even and odd rows, so
 * that consecutive multiply-adds do not wait on each other); dv % 32 columns take a plain loop. */
#if defined(__AVX2__) && !defined(__AVX512F__)
/* The 8 columns e0.. of one 32-column block of update_and_products on one AVX2 register, the
 * same fused multiply-adds as GCC makes of the vf form under -ffp-contract=fast (bit-equal,
 * checked): with the 64-byte vf it spills the block's sums through the stack and general
 * registers, and a 512-token KDA prefill chunk took 18.0 ms instead of 2.5 here (4 heads of
 * 64 x 64, an AVX2 EPYC). */
static inline void update_and_products8(float *restrict S, const float *a, const float *k, const float *delta,
                                        const float *x, const float *y, int dk, int dv, int e0, float *restrict p,
                                        float *restrict r) {
    const __m256 dl = _mm256_loadu_ps(delta + e0);
    __m256 p_even = _mm256_setzero_ps(), p_odd = p_even, r_even = p_even, r_odd = p_even;
    for (int d = 0; d < dk; d += 2) {
        float *row = S + (int64_t)d * dv + e0, *next = row + dv;
        const __m256 s0 = _mm256_fmadd_ps(_mm256_set1_ps(a[d]), _mm256_loadu_ps(row), _mm256_mul_ps(_mm256_set1_ps(k[d]), dl));
        const __m256 s1 = _mm256_fmadd_ps(_mm256_set1_ps(a[d + 1]), _mm256_loadu_ps(next), _mm256_mul_ps(_mm256_set1_ps(k[d + 1]), dl));
        _mm256_storeu_ps(row, s0);
        _mm256_storeu_ps(next, s1);
        p_even = _mm256_fmadd_ps(_mm256_set1_ps(x[d]), s0, p_even);
        p_odd = _mm256_fmadd_ps(_mm256_set1_ps(x[d + 1]), s1, p_odd);
        r_even = _mm256_fmadd_ps(_mm256_set1_ps(y[d]), s0, r_even);
        r_odd = _mm256_fmadd_ps(_mm256_set1_ps(y[d + 1]), s1, r_odd);
    }
    _mm256_storeu_ps(p + e0, _mm256_add_ps(p_even, p_odd));
    _mm256_storeu_ps(r + e0, _mm256_add_ps(r_even, r_odd));
}
#endif

static void update_and_products(float *restrict S, const float *a, const float *k, const float *delta, const float *x,
                                const float *y, int dk, int dv, float *restrict p, float *restrict r) {
    int e0 = 0;
#if defined(__AVX2__) && !defined(__AVX512F__)
    for (; e0 + 2 * VL <= dv && dk % 2 == 0; e0 += 2 * VL)
        for (int e = e0; e < e0 + 2 * VL; e += 8) update_and_products8(S, a, k, delta, x, y, dk, dv, e, p, r);
#endif
    for (; e0 + 2 * VL <= dv && dk % 2 == 0; e0 += 2 * VL) {
        const vf d0 = *(const vf_u *)(delta + e0), d1 = *(const vf_u *)(delta + e0 + VL);
        vf p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0}, r0 = {0}, r1 = {0}, r2 = {0}, r3 = {0};
        for (int d = 0; d < dk; d += 2) {
            vf_u *row = (vf_u *)(S + (int64_t)d * dv + e0), *next = (vf_u *)(S + (int64_t)(d + 1) * dv + e0);
            const vf s0 = a[d] * row[0] + k[d] * d0, s1 = a[d] * row[1] + k[d] * d1;
            const vf s2 = a[d + 1] * next[0] + k[d + 1] * d0, s3 = a[d + 1] * next[1] + k[d + 1] * d1;
            row[0] = s0, row[1] = s1, next[0] = s2, next[1] = s3;
            p0 += x[d] * s0, p1 += x[d] * s1, p2 += x[d + 1] * s2, p3 += x[d + 1] * s3;
            r0 += y[d] * s0, r1 += y[d] * s1, r2 += y[d + 1] * s2, r3 += y[d + 1] * s3;
        }
        *(vf_u *)(p + e0) = p0 + p2, *(vf_u *)(p + e0 + VL) = p1 + p3;
        *(vf_u *)(r + e0) = r0 + r2, *(vf_u *)(r + e0 + VL) = r1 + r3;
    }
    if (e0 == dv) return;
    for (int e = e0; e < dv; e++) p[e] = r[e] = 0.0f;
    for (int d = 0; d < dk; d++) {
        float *restrict row = S + (int64_t)d * dv;
        for (int e = e0; e < dv; e++) {
            const float s = a[d] * row[e] + k[d] * delta[e];
            row[e] = s;
            p[e] += x[d] * s;
            r[e] += y[d] * s;
        }
    }
}

/* Prefill: for each request b, lens[b] consecutive write-back steps on tokens starts[b] ..
 * (packed as for kda_replay_run; `decay` = exp(g), taken whole from the caller's vectorised
 * exp), on its state in the table, which is zeroed first where fresh[b] (a request with no
 * context yet). One pass over S per token: the update for token t and the products that
 * token t + 1 reads are made together. Tasks are (request, head). */
int kda_writeback_run(const float *q, const float *k, const float *v, const float *decay, const float *beta,
                      void *states, const int64_t *slots, const int64_t *starts, const int64_t *lens,
                      const uint8_t *fresh, int64_t batch, int heads, int dk, int dv, int is_bf16, float *out,
                      int threads) {
    if (dk > MAX_D || dv > MAX_D) return -1;
    States table;
    if (states_open(&table, states, is_bf16, dk, dv, threads) != 0) return -3;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t bh = 0; bh < batch * heads; bh++) {
        const int64_t b = bh / heads, n = lens[b], index = slots[b] * heads + bh % heads;
        const int h = (int)(bh % heads);
        float *S = fresh[b] ? state_zero(&table, index) : state_get(&table, index);
        if (n == 0) {
            if (fresh[b]) state_put(&table, index, S);
            continue;
        }
        float x[MAX_D], y[MAX_D], p[MAX_D], r[MAX_D], delta[MAX_D];
        int64_t th = starts[b] * heads + h; /* row of (token, head) */
        decay_inputs(q + th * dk, k + th * dk, decay + th * dk, dk, x, y);
        two_products(S, x, y, dk, dv, p, r);
        for (int64_t t = 0; t < n; t++, th += heads) {
            const float *kh = k + th * dk, *a = decay + th * dk;
            delta_and_output(q + th * dk, kh, v + th * dv, beta[th], p, r, dk, dv, delta, out + th * dv);
            if (t + 1 == n) {
                for (int d = 0; d < dk; d++) {
                    float *restrict row = S + (int64_t)d * dv;
                    for (int e = 0; e < dv; e++) row[e] = a[d] * row[e] + kh[d] * delta[e];
                }
                state_put(&table, index, S);
                break;
            }
            const int64_t next = th + heads;
            decay_inputs(q + next * dk, k + next * dk, decay + next * dk, dk, x, y);
            update_and_products(S, a, kh, delta, x, y, dk, dv, p, r);
        }
    }
    return 0;
}

/* p = x^T S and r = y^T S of a checkpoint S (bf16 when `bf16`: only where products16 reads it).
 * products16 and two_products make the same sums in the same order, as fused multiply-adds
 * (two_products through -ffp-contract=fast: the build flags keep fp32 results bit-stable). */
static void checkpoint_products(const void *S, int bf16, const float *x, const float *y, int dk, int dv, float *p,
                                float *r) {
#ifdef __AVX512F__
    if (dv % 16 == 0) {
        if (bf16) products16(S, 1, x, y, dk, dv, p, r);
        else products16(S, 0, x, y, dk, dv, p, r);
        return;
    }
#endif
    two_products((const float *)S, x, y, dk, dv, p, r);
}

/* The checkpoint of state `index` as a replay step reads it: the table's own where the products
 * can read it in place (fp32, or bf16 on the AVX-512 products: `*bf16` set), else a widened
 * copy. */
static const void *checkpoint(const States *table, int64_t index, int dv, int *bf16) {
    *bf16 = 0;
#ifdef __AVX512F__
    if (dv % 16 == 0 && table->is_bf16) {
        *bf16 = 1;
        return (const uint16_t *)table->table + index * table->size;
    }
#else
    (void)dv;
#endif
    return state_get(table, index);
}

/* Fold the first n ring entries of (slot, h) into its checkpoint in the table. */
static void fold_checkpoint(const States *table, const Ring *ring, int64_t slot, int h, int n) {
    if (n <= 0) return; /* (an empty ring: nothing to fold) */
    const int64_t index = slot * ring->heads + h;
    float *S = state_get(table, index);
    fold(S, ring, slot, h, n);
    state_put(table, index, S);
}

/* One replay step of head h of the request in `slot`, whose ring holds n < len entries, from
 * checkpoint S (`checkpoint`): writes ring entry n and o [Dv]. */
static void replay_token(const Ring *ring, const void *S, int S_bf16, int64_t slot, int h, int n, const float *qh,
                         const float *kh, const float *gh, const float *vh, float beta, float *o) {
    const int dk = ring->dk, dv = ring->dv;
    const float *prev = n ? entry(ring, ring->decays, slot, n - 1, h, dk) : 0;
    float *G = entry(ring, ring->decays, slot, n, h, dk), *key = entry(ring, ring->keys, slot, n, h, dk);
    float A[MAX_D], x[MAX_D], y[MAX_D], p[MAX_D], r[MAX_D];
    for (int d = 0; d < dk; d++) {
        G[d] = (prev ? prev[d] : 0.0f) + gh[d];
        A[d] = expf(G[d]);
        x[d] = qh[d] * A[d];
        y[d] = kh[d] * A[d];
    }
    checkpoint_products(S, S_bf16, x, y, dk, dv, p, r);
    for (int j = 0; j < n; j++) {
        const float *kj = entry(ring, ring->keys, slot, j, h, dk);
        float c = 0.0f, s = 0.0f;
        if (ring->exact) {
            const float *Gj = entry(ring, ring->decays, slot, j, h, dk);
            for (int d = 0; d < dk; d++) {
                const float w = kj[d] * expf(G[d] - Gj[d]);
                c += kh[d] * w;
                s += qh[d] * w;
            }
        } else {
            dot2(y, x, kj, dk, &c, &s);
        }
        const float *restrict dj = entry(ring, ring->deltas, slot, j, h, dv);
        for (int e = 0; e < dv; e++) {
            r[e] += c * dj[e];
            p[e] += s * dj[e];
        }
    }
    delta_and_output(qh, kh, vh, beta, p, r, dk, dv, entry(ring, ring->deltas, slot, n, h, dv), o);
    for (int d = 0; d < dk; d++) key[d] = ring->exact ? kh[d] : kh[d] / A[d];  // A >= e^-80 here: a normal fp32
}

/* Returns 0, -1 for head dims above MAX_D, -3 without scratch (bf16 tables). */
int kda_replay_step(const float *q, const float *k, const float *v, const float *g, const float *beta, void *states,
                    float *ring_keys, float *ring_decays, float *ring_deltas, const int64_t *slots,
                    const int64_t *counts, int64_t batch, int heads, int dk, int dv, int ring_len, int exact,
                    int is_bf16, float *out, int threads) {
    if (dk > MAX_D || dv > MAX_D) return -1;
    const Ring ring = {ring_keys, ring_decays, ring_deltas, ring_len, heads, dk, dv, exact};
    States table;
    if (states_open(&table, states, is_bf16, dk, dv, threads) != 0) return -3;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t bh = 0; bh < batch * heads; bh++) {
        const int64_t b = bh / heads, slot = slots[b];
        const int h = (int)(bh % heads);
        int n = (int)counts[b], S_bf16;
        if (n == ring_len) { /* (the steps after it read the checkpoint as the table holds it: rounded) */
            fold_checkpoint(&table, &ring, slot, h, n);
            n = 0;
        }
        const void *S = checkpoint(&table, slot * heads + h, dv, &S_bf16);
        replay_token(&ring, S, S_bf16, slot, h, n, q + bh * dk, k + bh * dk, g + bh * dk, v + bh * dv, beta[bh],
                     out + bh * dv);
    }
    return 0;
}

/* Verifies: for each request b, lens[b] consecutive replay steps on tokens starts[b] ..
 * (packed request after request: q, k, g [T, H, Dk], v and out [T, H, Dv], beta [T, H]),
 * appended to its ring after counts[b] entries; a ring that cannot take them all is folded
 * first (as the host's book counts: a run of lens[b] <= ring_len then starts it). One pass
 * per head keeps the steps of a request in order and its checkpoint and ring in cache. */
int kda_replay_run(const float *q, const float *k, const float *v, const float *g, const float *beta, void *states,
                   float *ring_keys, float *ring_decays, float *ring_deltas, const int64_t *slots, const int64_t *counts,
                   const int64_t *starts, const int64_t *lens, int64_t batch, int heads, int dk, int dv, int ring_len,
                   int exact, int is_bf16, float *out, int threads) {
    if (dk > MAX_D || dv > MAX_D) return -1;
    for (int64_t b = 0; b < batch; b++)
        if (lens[b] > ring_len) return -2;
    const Ring ring = {ring_keys, ring_decays, ring_deltas, ring_len, heads, dk, dv, exact};
    States table;
    if (states_open(&table, states, is_bf16, dk, dv, threads) != 0) return -3;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t bh = 0; bh < batch * heads; bh++) {
        const int64_t b = bh / heads, slot = slots[b];
        const int h = (int)(bh % heads);
        int n = (int)counts[b], S_bf16;
        if (n + lens[b] > ring_len) {
            fold_checkpoint(&table, &ring, slot, h, n);
            n = 0;
        }
        const void *S = checkpoint(&table, slot * heads + h, dv, &S_bf16);
        for (int64_t t = 0; t < lens[b]; t++) {
            const int64_t th = (starts[b] + t) * heads + h;
            replay_token(&ring, S, S_bf16, slot, h, n + (int)t, q + th * dk, k + th * dk, g + th * dk, v + th * dv, beta[th],
                         out + th * dv);
        }
    }
    return 0;
}

/* Fold each request's first counts[b] ring entries into its checkpoint (before a prefill
 * chunk reads the state). */
int kda_replay_fold(void *states, float *ring_keys, float *ring_decays, float *ring_deltas, const int64_t *slots,
                    const int64_t *counts, int64_t batch, int heads, int dk, int dv, int ring_len, int exact,
                    int is_bf16, int threads) {
    const Ring ring = {ring_keys, ring_decays, ring_deltas, ring_len, heads, dk, dv, exact};
    States table;
    if (states_open(&table, states, is_bf16, dk, dv, threads) != 0) return -3;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t bh = 0; bh < batch * heads; bh++) {
        const int64_t b = bh / heads;
        const int h = (int)(bh % heads);
        if (counts[b] > 0) fold_checkpoint(&table, &ring, slots[b], h, (int)counts[b]);
    }
    return 0;
}
