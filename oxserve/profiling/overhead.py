"""What telemetry itself costs, measured two ways.

1. The span machinery alone: a tight loop of empty `span(...)` blocks, with no tracer (the
   production path) and with one, minus the bare loop. Times the spans a step opens, this
   is the cost per step, as a share of the measured step time.
2. End to end: the same short segment of the workload run alternately with and without a
   tracer (ABAB...), median wall time of each. On CUDA this includes the device syncs at
   span edges, which (1) cannot see. Noisy on a shared machine: a check, not a figure to
   subtract.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

from oxserve.feedback.drive import run_workload
from oxserve.feedback.workload import Arrival, WorkloadRequest
from oxserve.telemetry import Tracer, span

LOOP = 20_000


@dataclass(frozen=True)
class SpanCost:
    off_ns: float  # per span(None, ...) block
    on_ns: float  # per span(tracer, ...) block, recording included


def measure_span_cost(loops: int = LOOP, repeats: int = 5) -> SpanCost:
    """Best of `repeats` per-span costs (the minimum is the least disturbed by other load)."""
    def per_call(tracer: Tracer | None) -> float:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            for _ in range(loops):
                pass
            bare = time.perf_counter_ns() - t0
            t0 = time.perf_counter_ns()
            for _ in range(loops):
                with span(tracer, "L0.kda.recurrent"):
                    pass
            best = min(best, (time.perf_counter_ns() - t0 - bare) / loops)
            if tracer is not None:
                tracer.spans.clear()
        return max(best, 0.0)

    return SpanCost(off_ns=per_call(None), on_ns=per_call(Tracer()))


def span_overhead(cost: SpanCost, spans_per_step: float, median_step_us: float) -> dict:
    per_step_off_us = cost.off_ns * spans_per_step / 1e3
    per_step_on_us = cost.on_ns * spans_per_step / 1e3
    return {
        "span_off_ns": cost.off_ns,
        "span_on_ns": cost.on_ns,
        "spans_per_step": spans_per_step,
        "median_step_us": median_step_us,
        "off_us_per_step": per_step_off_us,
        "on_us_per_step": per_step_on_us,
        "off_fraction": per_step_off_us / median_step_us if median_step_us else 0.0,
        "on_fraction": per_step_on_us / median_step_us if median_step_us else 0.0,
    }


def end_to_end_overhead(engine, requests: list[WorkloadRequest], arrival: Arrival, repeats: int, max_tokens: int = 8) -> dict:
    """Median wall time of a short segment with and without a tracer, interleaved."""
    segment = [
        replace(r, sampling={**dict(r.sampling), "max_tokens": min(max_tokens, r.output_len)})
        for r in requests[:4]
    ]
    closed = Arrival(concurrency=arrival.concurrency or len(segment))  # no waiting for arrivals
    walls: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(repeats):
        for mode in ("off", "on"):
            tracer = Tracer(str(engine.device)) if mode == "on" else None
            engine.runner.tracer = tracer
            walls[mode].append(run_workload(engine, segment, closed, tracer).wall_s)
    engine.runner.tracer = None
    off, on = statistics.median(walls["off"]), statistics.median(walls["on"])
    return {
        "segment_requests": len(segment),
        "repeats": repeats,
        "off_median_s": off,
        "on_median_s": on,
        "on_over_off": on / off,
        "off_s": walls["off"],
        "on_s": walls["on"],
    }
