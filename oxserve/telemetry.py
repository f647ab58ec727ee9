"""Timed spans for localized feedback: which op, in which layer, under which conditions.

A `Tracer` is handed to the code explicitly (the runner puts it on the `ForwardBatch`); when
there is none, `span(None, ...)` is a shared no-op context, so telemetry off costs one
attribute lookup and a function call per op.

    with span(tracer, "L7.kda.recurrent"):
        ...

On CPU spans use `time.perf_counter_ns` (torch CPU ops are synchronous). On CUDA the tracer
synchronizes the device at span edges, so a span measures the kernels it launched.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

_NULL = contextlib.nullcontext()


@dataclass
class Span:
    name: str
    start_us: float
    dur_us: float
    track: str
    depth: int
    args: dict[str, Any] = field(default_factory=dict)


class Tracer:
    def __init__(self, device: torch.device | str = "cpu"):
        self.spans: list[Span] = []
        self._cuda = torch.device(device).type == "cuda"
        self.depth = 0
        self._origin = time.perf_counter_ns()
        self.pid = os.getpid()
        self.tid = threading.get_ident()

    def now_us(self) -> float:
        return (time.perf_counter_ns() - self._origin) / 1000.0

    def synced_now_us(self) -> float:
        """`now_us` once the device has finished what was queued (kernels, not launches, timed)."""
        if self._cuda:
            torch.cuda.synchronize()
        return self.now_us()

    @contextlib.contextmanager
    def span(self, name: str, track: str = "model", **args: Any) -> Iterator[dict[str, Any]]:
        """Time a block; the yielded dict can receive more arguments while it runs."""
        if self._cuda:
            torch.cuda.synchronize()
        start = self.now_us()
        depth = self.depth
        self.depth += 1
        try:
            yield args
        finally:
            if self._cuda:
                torch.cuda.synchronize()
            self.depth -= 1
            self.spans.append(Span(name, start, self.now_us() - start, track, depth, args))


def span(tracer: Tracer | None, name: str, track: str = "model", **args: Any):
    return _NULL if tracer is None else tracer.span(name, track, **args)
