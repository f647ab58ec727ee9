"""Keep freed activation memory in the process between engine steps (glibc malloc).

Every step allocates its activations afresh. glibc serves blocks above its mmap threshold
(128 KiB at start) with fresh `mmap`s and returns the top of the heap to the kernel once
more than 128 KiB is free there, so each step's activations are unmapped when freed and
faulted in again, page by page, by the next step: about a million minor page faults and a
third of the process's CPU time in the kernel for a short CPU benchmark (docs/performance.md).
Raising both thresholds keeps that memory mapped and reused (what the jemalloc/tcmalloc
preloads of vLLM's and SGLang's CPU backends achieve). It costs resident memory up to the
largest step's working set, which the process would need at its peak anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: trim only past 2 GiB of free heap top


def keep_freed_memory() -> bool:
    """Set glibc's thresholds so freed blocks stay mapped; False where libc is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("mallopt refused the thresholds; freed memory goes back to the OS each step")
    return ok
