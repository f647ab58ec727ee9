/* Per-call scratch memory of the native kernels: one block per calling thread, kept between
 * calls and reused. A decode step makes about a hundred kernel calls, and malloc of their
 * scratch on the engine's long-lived heap (its freed memory stays mapped) measured 4% of a
 * batch-1 W8A8 step under perf. A block above SCRATCH_KEEP bytes is given back by
 * scratch_done(). Each library has its own block (the static below is per shared object); an
 * entry point takes all its scratch from one scratch_reserve (no nesting). Kernels that
 * include this header are rebuilt when it changes. */
#ifndef OXSERVE_SCRATCH_H
#define OXSERVE_SCRATCH_H
#include <stddef.h>
#include <stdlib.h>

#define SCRATCH_KEEP ((size_t)64 << 20)
#define SCRATCH_ALIGN 64

static _Thread_local struct {
    char *base;
    size_t size, used;
} scratch_block;

/* What `bytes` take of a block: scratch_reserve wants the sum of these. */
static inline size_t scratch_padded(size_t bytes) { return (bytes + SCRATCH_ALIGN - 1) / SCRATCH_ALIGN * SCRATCH_ALIGN; }

/* Room for `bytes` from the start of this thread's block (earlier takes are void): 0, or -1
 * without memory. */
static inline int scratch_reserve(size_t bytes) {
    scratch_block.used = 0;
    if (bytes < SCRATCH_ALIGN) bytes = SCRATCH_ALIGN; /* a block even for an empty call: no NULL arithmetic */
    if (bytes <= scratch_block.size) return 0;
    free(scratch_block.base);
    scratch_block.size = scratch_padded(bytes);
    scratch_block.base = aligned_alloc(SCRATCH_ALIGN, scratch_block.size);
    if (scratch_block.base == NULL) scratch_block.size = 0;
    return scratch_block.base ? 0 : -1;
}

/* The next `bytes` of the reserved room (contents undefined), SCRATCH_ALIGN-aligned. */
static inline void *scratch_take(size_t bytes) {
    void *p = scratch_block.base + scratch_block.used;
    scratch_block.used += scratch_padded(bytes);
    return p;
}

/* The call is done with its scratch: a large block goes back to the heap. */
static inline void scratch_done(void) {
    if (scratch_block.size <= SCRATCH_KEEP) return;
    free(scratch_block.base);
    scratch_block.base = NULL;
    scratch_block.size = 0;
}

#endif
