/* The routed experts' (token, slot) pairs, sorted by expert: shared by the bf16 and int8 panel
 * kernels. Kernels that include this header are rebuilt when it changes. */
#ifndef OXSERVE_PAIRS_H
#define OXSERVE_PAIRS_H
#include <stdint.h>

/* Counting sort of the P pairs' expert ids (stable): slot_of[p] = pair p's sorted position;
 * offsets [E], zeroed by the caller, first hold where each expert's rows start and, once the
 * pairs are placed, where they end (what the grouped products take). */
static inline void sort_pairs(const int64_t *ids, int64_t P, int64_t E, int32_t *offsets, int64_t *slot_of) {
    for (int64_t p = 0; p < P; p++) offsets[ids[p]]++;
    for (int64_t e = 0, start = 0; e < E; e++) {
        const int32_t count = offsets[e];
        offsets[e] = (int32_t)start;
        start += count;
    }
    for (int64_t p = 0; p < P; p++) slot_of[p] = offsets[ids[p]]++;
}

/* A token's pairs in sorted (expert) order: the first of its k sorted positions `slots` after
 * `done_below` (-1 to start). */
static inline int64_t next_pair(const int64_t *slots, int64_t k, int64_t done_below) {
    int64_t next = -1;
    for (int64_t j = 0; j < k; j++)
        if (slots[j] > done_below && (next < 0 || slots[j] < next)) next = slots[j];
    return next;
}

#endif
