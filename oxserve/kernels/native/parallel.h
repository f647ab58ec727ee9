/* Thread teams only for work that pays for them. Forking and joining a team costs a few
 * microseconds, more than many of a decode step's kernels compute for one or a few requests
 * (tasks of a single token, a 256 x 256 product), and a team of one task is all cost. Kernels
 * put `if (worth_threads(work))` on their parallel regions, work counted in multiply-adds or
 * element operations; results never depend on it (a task's arithmetic is the same on any
 * thread). */
#ifndef OXSERVE_PARALLEL_H
#define OXSERVE_PARALLEL_H
#include <stdint.h>

#define PARALLEL_MIN_WORK 65536

static inline int worth_threads(int64_t work) { return work >= PARALLEL_MIN_WORK; }

#endif
