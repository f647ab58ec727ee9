"""Keep freed activation memory in the process between engine steps (glibc malloc).

Every step allocates its activations afresh. glibc serves blocks above its mmap threshold
(128 KiB at start) with fresh `mmap`s and returns the top of the heap to the kernel once
more than 128 KiB is free there, so each step's activations are unmapped when freed and
faulted in again, page by page, by the next step: 280k minor page faults in one short CPU
generate, against 52k with the thresholds raised (docs/performance.md, docs/bench/page_faults.py).
Raising both thresholds keeps that memory mapped and reused (what the jemalloc/tcmalloc
preloads of vLLM's and SGLang's CPU backends achieve). It costs resident memory up to the
largest step's working set, which the process would need at its peak anyway.

What the heap holds is measured here too (`heap_stats`: bytes in use, free bytes malloc keeps,
arenas; the server's /metrics shows them), and `IdleTrim` gives free pages back while the engine
is idle: memory freed amid long-lived blocks (oneDNN's per-shape caches) is otherwise kept
resident for good (docs/reliability.md#soak).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

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


# ---- what the heap holds: in use, or freed and kept (glibc mallinfo2 / malloc_info) ----------


class _Mallinfo2(ctypes.Structure):  # struct mallinfo2 (malloc.h, glibc >= 2.33): every field a size_t
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


@dataclass(frozen=True)
class HeapStats:
    """glibc's heap, all arenas together, in bytes.

    `in_use` (uordblks + hblkhd) is what the program holds: it climbs under a leak. `free_held`
    (fordblks) is memory freed to malloc and kept by it, resident or not: it climbs under
    allocator retention while `in_use` stays flat. Neither counts memory mapped outside malloc
    (Python's small-object arenas, mmapped files)."""

    in_use: int
    free_held: int
    mmapped: int  # hblkhd: blocks past the mmap threshold, part of in_use
    arenas: int  # malloc arenas (main + per-thread); 0 where malloc_info is missing


@functools.cache
def _libc() -> ctypes.CDLL | None:
    libc = ctypes.CDLL(None)
    if getattr(libc, "mallinfo2", None) is None:  # not glibc, or glibc < 2.33
        return None
    libc.mallinfo2.restype = _Mallinfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
    libc.open_memstream.restype = ctypes.c_void_p
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def malloc_info_xml() -> str:
    """glibc's malloc_info(0) report (XML, one <heap> per arena); "" where it is missing."""
    libc = _libc()
    if libc is None:
        return ""
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if not stream:
        return ""
    try:
        libc.malloc_info(0, stream)
    finally:
        libc.fclose(stream)  # sets buf and size
    try:
        return ctypes.string_at(buf, size.value).decode()
    finally:
        libc.free(buf)


def heap_stats() -> HeapStats | None:
    """The heap now (None where libc has no mallinfo2). Locks each arena in turn while it
    walks its free lists: cheap, but not for a hot path."""
    libc = _libc()
    if libc is None:
        return None
    m = libc.mallinfo2()
    return HeapStats(m.uordblks + m.hblkhd, m.fordblks, m.hblkhd, malloc_info_xml().count("<heap nr="))


def release_free_memory() -> bool:
    """malloc_trim(0): give the free pages of every arena back to the OS (the tops of the heaps
    are unmapped, free chunks inside them are madvised away). True if any memory went back."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))


def resident_bytes() -> int | None:
    """This process's resident memory (RSS) now; None off Linux."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


IDLE_TRIM_INTERVAL_S = 5.0


class IdleTrim:
    """Give the heap's free pages back to the OS while the engine has nothing to run.

    Freed memory that malloc keeps grows where allocations of ever new sizes meet long-lived
    ones (oneDNN's per-shape primitive caches: docs/reliability.md#soak), and with the trim
    threshold at 2 GiB nothing gives it back. `idle()` is for the engine's own thread, between
    steps, when no request runs or waits: a step's activations stay mapped from one step to the
    next, and only an engine with nothing to do pays for the trim (1-50 ms) and for faulting
    pages in again after it. At most once every `interval_s`.
    """

    def __init__(self, interval_s: float = IDLE_TRIM_INTERVAL_S, trim: Callable[[], object] = release_free_memory,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.interval_s = interval_s
        self._trim, self._clock = trim, clock
        self._last = -math.inf
        self.trims = 0
        self.released_bytes = 0  # RSS given back, summed over the trims
        self.seconds = 0.0  # time spent trimming

    def wait_s(self) -> float:
        """Seconds until a trim is allowed again (0: now)."""
        return max(0.0, self._last + self.interval_s - self._clock())

    def idle(self) -> bool:
        """Trim now unless the last trim was less than `interval_s` ago; True if it trimmed."""
        start = self._clock()
        if start - self._last < self.interval_s:
            return False
        self._last = start
        before = resident_bytes()
        self._trim()
        after = resident_bytes()
        self.trims += 1
        self.seconds += self._clock() - start
        if before is not None and after is not None:
            self.released_bytes += max(0, before - after)
        return True


IDLE_TRIM = IdleTrim()  # the heap is the process's: one for every engine in it
