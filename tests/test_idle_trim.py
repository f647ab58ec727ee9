"""IdleTrim: malloc_trim at most once every interval, and what it gives back is counted."""

from __future__ import annotations

import subprocess
import sys

from oxserve.engine.memory import IdleTrim, heap_stats


def test_trims_at_most_once_per_interval():
    now, calls = [100.0], []
    trim = IdleTrim(interval_s=5.0, trim=lambda: calls.append(now[0]), clock=lambda: now[0])
    assert trim.idle() and calls == [100.0]
    now[0] = 104.9
    assert not trim.idle() and calls == [100.0], "within the interval: no second trim"
    now[0] = 105.0
    assert trim.idle() and calls == [100.0, 105.0] and trim.trims == 2


PROBE = """
import ctypes
from oxserve.engine.memory import IdleTrim, keep_freed_memory, resident_bytes
assert keep_freed_memory()  # the server's thresholds: nothing is given back on free
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
blocks = [libc.malloc(1 << 20) for _ in range(256)]  # 256 MiB in the heap, touched
for b in blocks:
    ctypes.memset(b, 1, 1 << 20)
keep = libc.malloc(64)  # a live block after them
for b in blocks:
    libc.free(b)
held = resident_bytes()
trim = IdleTrim()
assert trim.idle()
print(held, resident_bytes(), trim.released_bytes)
"""


def test_an_idle_trim_gives_freed_heap_pages_back():
    assert heap_stats() is not None, "glibc >= 2.33 (mallinfo2): the set-up's Debian has it"
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    held, after, released = map(int, out.stdout.split())
    assert released >= 200 << 20 and held - after >= 200 << 20, (held, after, released)
