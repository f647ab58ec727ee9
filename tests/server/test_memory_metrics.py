"""/metrics splits the heap into bytes in use and free bytes malloc holds, next to RSS: a leak
climbs in use, allocator retention climbs in free-held (docs/reliability.md#soak)."""

from __future__ import annotations

import ctypes
import time

from prometheus_client.parser import text_string_to_metric_families
from server_harness import server, tiny_model  # noqa: F401  (fixtures)

from oxserve.engine.engine import EngineStats
from oxserve.engine.memory import heap_stats
from oxserve.server.metrics import ServerMetrics

MEMORY_GAUGES = ("oxserve:resident_memory_bytes", "oxserve:heap_in_use_bytes", "oxserve:heap_free_held_bytes",
                 "oxserve:heap_mmapped_bytes", "oxserve:heap_arenas", "oxserve:heap_trims_total",
                 "oxserve:heap_trim_released_bytes_total", "oxserve:heap_trim_seconds_total")  # fmt: skip


def _scrape() -> dict[str, float]:
    metrics = ServerMetrics(lambda: EngineStats(0, 0, 0, 0.0, 0, 0, 0))
    return {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}


def test_memory_gauges_are_in_metrics_and_consistent():
    assert heap_stats() is not None, "glibc >= 2.33 (mallinfo2): the set-up's Debian has it"
    m = _scrape()
    assert all(name in m for name in MEMORY_GAUGES), sorted(m)
    assert m["oxserve:heap_in_use_bytes"] > 0 and m["oxserve:heap_free_held_bytes"] >= 0 and m["oxserve:heap_arenas"] >= 1
    assert m["oxserve:heap_mmapped_bytes"] <= m["oxserve:heap_in_use_bytes"]
    # Touched heap memory is resident; RSS also holds what malloc never saw (code, Python's arenas).
    assert m["oxserve:heap_in_use_bytes"] < m["oxserve:resident_memory_bytes"] * 1.5


def test_in_use_follows_an_allocation_and_its_free():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    size = 8 << 20  # a heap block or an mmapped one, as the thresholds are set: in use either way
    before = _scrape()["oxserve:heap_in_use_bytes"]
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    during = _scrape()["oxserve:heap_in_use_bytes"]
    libc.free(block)
    after = _scrape()["oxserve:heap_in_use_bytes"]
    slack = 64 << 10  # other threads of this process allocate and free small blocks meanwhile (16 bytes seen)
    assert during - before >= size - slack and during - after >= size - slack, (before, during, after)


def test_the_server_trims_the_heap_once_idle_after_work(server):
    before = server.metrics()["oxserve:heap_trims_total"]
    server.client().completions.create(model=None, prompt="a few words", max_tokens=4)
    deadline = time.monotonic() + 15  # the trim waits out the 5 s since the previous one
    while (after := server.metrics())["oxserve:heap_trims_total"] == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert after["oxserve:heap_trims_total"] == before + 1, "one trim per idle spell"
    assert after["oxserve:heap_trim_seconds_total"] > 0
    time.sleep(6)
    assert server.metrics()["oxserve:heap_trims_total"] == before + 1, "no work since: no second trim"
