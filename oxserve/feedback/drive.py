"""Run a workload against an in-process engine and time every request.

Two arrival modes, as the workload says (`Arrival`):

    closed loop   keep `concurrency` requests in flight; a new one is added as one finishes
    timed         add each request once its arrival offset has passed; idle until the next

Latencies count from the moment a request was due (its arrival offset, or its admission in
the closed loop), so queueing behind a long step shows up in TTFT. Used by `oxserve profile`
and by the experiment worker, so both measure the same thing.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from oxserve.feedback.workload import Arrival, WorkloadRequest
from oxserve.sampling_params import SamplingParams
from oxserve.telemetry import Tracer, span

# Random prompt ids start here: small ids are where GLM-style tokenizers keep special tokens.
PROMPT_MIN_TOKEN_ID = 16


@dataclass(frozen=True)
class RequestTiming:
    index: int
    prompt_len: int
    num_output_tokens: int
    due_s: float  # when the request was due, from the start of the run
    first_token_s: float
    finish_s: float

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.due_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None for single-token outputs."""
        if self.num_output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.num_output_tokens - 1)


@dataclass(frozen=True)
class RunResult:
    wall_s: float
    num_steps: int
    requests: tuple[RequestTiming, ...]

    def metrics(self) -> dict[str, float]:
        """Flat, finite numbers (what the ledger stores). Higher is better only for *_per_s."""
        out_tokens = sum(r.num_output_tokens for r in self.requests)
        metrics = {
            "output_tokens_per_s": out_tokens / self.wall_s,
            "total_time_s": self.wall_s,
            "num_output_tokens": float(out_tokens),
            "num_requests": float(len(self.requests)),
            "num_steps": float(self.num_steps),
        }
        metrics.update(_summary("ttft", [r.ttft_s for r in self.requests]))
        metrics.update(_summary("tpot", [r.tpot_s for r in self.requests if r.tpot_s is not None]))
        return {k: v for k, v in metrics.items() if math.isfinite(v)}


def run_workload(engine, requests: list[WorkloadRequest], arrival: Arrival, tracer: Tracer | None = None) -> RunResult:
    """Drive `engine` (an `LLMEngine`) through `requests`; with a tracer, each step is a span."""
    pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.index)))
    due: dict[str, tuple[WorkloadRequest, float]] = {}
    first: dict[str, float] = {}
    done: list[RequestTiming] = []
    steps = 0
    start = time.perf_counter()
    while pending or due:
        now = time.perf_counter() - start
        while pending and _may_admit(arrival, pending[0], len(due), now):
            request = pending.popleft()
            rid = f"w{request.index}"
            engine.add_request(rid, list(request.prompt_token_ids), SamplingParams(**dict(request.sampling)))
            due[rid] = (request, now if arrival.concurrency is not None else request.arrival_s)
        if not due:  # open loop, nothing in flight: wait for the next arrival
            time.sleep(max(0.0, pending[0].arrival_s - now))
            continue
        with span(tracer, "step", track="engine"):
            outputs = engine.step()
        steps += 1
        now = time.perf_counter() - start
        for out in outputs:
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = now
            if out.finished:
                request, due_s = due.pop(out.request_id)
                done.append(RequestTiming(
                    index=request.index, prompt_len=request.input_len,
                    num_output_tokens=len(out.outputs[0].token_ids),
                    due_s=due_s, first_token_s=first.pop(out.request_id, now), finish_s=now,
                ))
    return RunResult(wall_s=time.perf_counter() - start, num_steps=steps, requests=tuple(sorted(done, key=lambda r: r.index)))


def _may_admit(arrival: Arrival, request: WorkloadRequest, in_flight: int, now: float) -> bool:
    if arrival.concurrency is not None:
        return in_flight < arrival.concurrency
    return request.arrival_s <= now


def _summary(name: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values, dtype=np.float64)
    return {
        f"{name}_mean_s": float(arr.mean()),
        f"{name}_p50_s": float(np.percentile(arr, 50)),
        f"{name}_p90_s": float(np.percentile(arr, 90)),
    }
