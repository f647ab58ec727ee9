"""Tracer spans, grouped by time containment into steps -> forward passes -> op spans.

    step ─┬─ schedule
          ├─ prepare_inputs
          ├─ forward (conditions in args) ─┬─ embed
          │                                ├─ L0.hc.collapse, L0.kda.qkv_proj, ... L7.hc.expand
          │                                ├─ final_norm
          │                                └─ lm_head
          ├─ sample
          └─ postprocess

A step holds one forward pass, or one per request in deterministic mode. Model spans are
all depth-1 inside their forward (the model emits no per-layer span); `layer_of` recovers
the layer from the name.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

from oxserve.profiling.costs import StepShape
from oxserve.telemetry import Span

_LAYER = re.compile(r"^L(\d+)\.(.+)$")


@dataclass(frozen=True)
class OpSpan:
    name: str  # "L3.mla.attention", "lm_head"
    start_us: float
    dur_us: float

    @property
    def layer(self) -> int | None:
        m = _LAYER.match(self.name)
        return int(m.group(1)) if m else None

    @property
    def op_type(self) -> str:
        """The name without its layer: "kda.recurrent" for every L*.kda.recurrent."""
        m = _LAYER.match(self.name)
        return m.group(2) if m else self.name


@dataclass(frozen=True)
class ForwardPass:
    start_us: float
    dur_us: float
    shape: StepShape
    ops: tuple[OpSpan, ...]


@dataclass(frozen=True)
class Step:
    start_us: float
    dur_us: float
    forwards: tuple[ForwardPass, ...]
    engine_spans: tuple[Span, ...]  # schedule, prepare_inputs, forward, sample, postprocess

    @property
    def phase(self) -> str | None:
        """decode / prefill / mixed, or None for a step that ran no forward pass."""
        phases = {f.shape.phase for f in self.forwards}
        if not phases:
            return None
        return phases.pop() if len(phases) == 1 else "mixed"

    @property
    def num_requests(self) -> int:
        return sum(f.shape.num_requests for f in self.forwards)


def group_spans(spans: list[Span]) -> list[Step]:
    """Steps in time order. Spans outside any step (none when the workload driver ran) are dropped."""
    ordered = sorted(spans, key=lambda s: (s.start_us, -s.dur_us))
    steps = [s for s in ordered if s.track == "engine" and s.name == "step"]
    forwards = [s for s in ordered if s.track == "engine" and s.name == "forward"]
    engine = _ByStart([s for s in ordered if s.track == "engine" and s.name != "step"])
    model = _ByStart([s for s in ordered if s.track == "model"])
    passes = _ByStart([
        ForwardPass(f.start_us, f.dur_us, StepShape.from_args(f.args),
                    tuple(OpSpan(m.name, m.start_us, m.dur_us) for m in model.inside(f)))
        for f in forwards
    ])
    return [Step(s.start_us, s.dur_us, tuple(passes.inside(s)), tuple(engine.inside(s))) for s in steps]


class _ByStart:
    """Spans sorted by start; `inside` finds those within an outer span by binary search,
    so grouping stays linear in the trace size."""

    def __init__(self, items: list):
        self.items = items
        self.starts = [s.start_us for s in items]

    def inside(self, outer: Span) -> list:
        end = outer.start_us + outer.dur_us
        lo, hi = bisect_left(self.starts, outer.start_us), bisect_right(self.starts, end)
        return [s for s in self.items[lo:hi] if s is not outer and s.start_us + s.dur_us <= end]
