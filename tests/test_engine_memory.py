"""Freed activation memory stays mapped: repeated step-sized allocations stop faulting.

The baseline is glibc with its starting thresholds held fixed (MALLOC_MMAP_THRESHOLD_): every
block past 128 KiB is a fresh mmap, unmapped when freed. glibc's own dynamic threshold catches
part of that by default, by an amount that varies from machine to machine (15k-230k faults for
this probe), so the default is no fixed baseline. Huge pages are turned off in the probe
(prctl PR_SET_THP_DISABLE) so that a fault is one 4 KiB page wherever it runs.
"""

import os
import subprocess
import sys

PROBE = """
import ctypes, resource, sys, torch
from oxserve.engine.memory import heap_stats, keep_freed_memory
assert ctypes.CDLL(None).prctl(41, 1, 0, 0, 0) == 0  # PR_SET_THP_DISABLE
if sys.argv[1] == "keep":
    assert keep_freed_memory()
SIZES = [n << 20 for n in (1, 3, 8, 20, 5, 12)]  # bytes: a step's activations, 1-20 MiB
def cycle():
    outside = heap_stats().mmapped  # blocks mapped before the step (torch's own)
    live = [torch.ones(n // 4) for n in SIZES]  # several live at once, written, then freed
    mmapped = heap_stats().mmapped - outside
    del live
    return mmapped
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    mmapped = cycle()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(faults, sum(SIZES) * 20 // resource.getpagesize(), mmapped, heap_stats().free_held)
"""
STEP_BYTES = (1 + 3 + 8 + 20 + 5 + 12) << 20


def _probe(mode: str, env: dict[str, str] | None = None) -> tuple[int, int, int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})})  # fmt: skip
    faults, pages, mmapped, free_held = map(int, out.stdout.split()[-4:])
    return faults, pages, mmapped, free_held


def test_kept_memory_is_reused_without_page_faults():
    returned = _probe("returned", {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)})
    kept = _probe("keep")
    faults, pages, mmapped, free_held = returned
    assert mmapped >= STEP_BYTES and free_held < STEP_BYTES, returned  # mapped per block, unmapped when freed
    assert faults > pages // 2, returned  # so each cycle faults its pages in again
    faults, pages, mmapped, free_held = kept
    assert mmapped == 0 and free_held >= STEP_BYTES, kept  # served from the heap, kept there when freed
    # Not zero everywhere: NUMA balancing's hinting faults on a multi-socket host count too.
    assert faults * 5 < returned[0], f"{faults} faults with the memory kept, {returned[0]} returned"
