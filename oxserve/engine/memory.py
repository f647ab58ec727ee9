"""Keep freed activation memory in the process between engine steps (glibc malloc).

Every step allocates its activations afresh. glibc serves blocks above its mmap threshold
(128 KiB at start) with fresh `mmap`s and returns the top of the heap to the kernel once
more than 128 KiB is free there, so each step's activations are unmapped when freed and
faulted in again, page by page, by the next step: 280k minor page faults in one short CPU
generate, against 52k with the thresholds raised (docs/performance.md, docs/bench/page_faults.py).
Raising both thresholds keeps that memory mapped and reused (what the jemalloc/tcmalloc
preloads of vLLM's and SGLang's CPU backends achieve). It costs resident memory up to the
largest step's working set, which the process would need at its peak anyway.
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: trim only past 2 GiB of free heap top


@functools.cache  # process-wide settings: once is enough, however many engines start
def keep_freed_memory() -> bool:
    """Set glibc's thresholds so freed blocks stay mapped; False where libc is not glibc."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the process's own libc symbols
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("mallopt refused the thresholds; freed memory goes back to the OS each step")
    return ok
