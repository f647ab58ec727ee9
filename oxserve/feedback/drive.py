"""Run a workload against an in-process engine and time every request.

Two arrival modes, as the workload says (`Arrival`):

    closed loop   keep `concurrency` requests in flight; a new one is added as one finishes
    timed         add each request once its arrival offset has passed; idle until the next

Latencies count from the moment a request was due (its arrival offset, or its admission in
the closed loop), so queueing behind a long step shows up in TTFT. A conversation's later
turn is due when its previous turn finishes; its prompt is that turn's prompt and output
followed by its own tokens, and it is sent ahead of requests not yet admitted. Used by `oxserve profile`
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
# Every name `RunResult.metrics` can report (the last six only for conversations or with a
# prefix cache): what goals and experiments may name.
RUN_METRICS = (
    "output_tokens_per_s", "total_time_s", "num_output_tokens", "num_requests", "num_steps",
    *(f"{name}_{stat}_s" for name in ("ttft", "tpot") for stat in ("mean", "p50", "p90")),
    "ttft_first_turn_mean_s", "ttft_later_turns_mean_s", "later_turn_first_tokens_per_s",
    "prefix_hit_tokens", "prefix_reusable_tokens", "prefix_hit_rate",
)


@dataclass(frozen=True)
class RequestTiming:
    index: int
    prompt_len: int
    num_output_tokens: int
    due_s: float  # when the request was due, from the start of the run
    first_token_s: float
    finish_s: float
    turn: int = 0  # within its conversation (0: the first, or not a conversation)
    reusable_tokens: int = 0  # prompt tokens an earlier request computed (a prefix cache could skip them)
    prompt: tuple[int, ...] = ()  # what was sent (a later turn's includes the history)
    output: tuple[int, ...] = ()  # what came back: experiments check it against the reference arm

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
    prefix_hits: int | None = None  # prompt tokens the engine's prefix cache served (None: no prefix cache)

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
        later = [r.ttft_s for r in self.requests if r.turn > 0]
        if later:  # as a rate too, so that experiments (which compare rates) can compare it
            metrics["ttft_first_turn_mean_s"] = float(np.mean([r.ttft_s for r in self.requests if r.turn == 0]))
            metrics["ttft_later_turns_mean_s"] = float(np.mean(later))
            metrics["later_turn_first_tokens_per_s"] = 1.0 / metrics["ttft_later_turns_mean_s"]
        if self.prefix_hits is not None:
            reusable = sum(r.reusable_tokens for r in self.requests)
            metrics["prefix_hit_tokens"] = float(self.prefix_hits)
            metrics["prefix_reusable_tokens"] = float(reusable)
            if reusable:
                metrics["prefix_hit_rate"] = self.prefix_hits / reusable
        return {k: v for k, v in metrics.items() if math.isfinite(v)}


def run_workload(engine, requests: list[WorkloadRequest], arrival: Arrival, tracer: Tracer | None = None) -> RunResult:
    """Drive `engine` (an `LLMEngine`) through `requests`; with a tracer, each step is a span."""
    later = {(r.conversation, r.turn): r for r in requests if r.turn > 0}
    pending = deque(sorted((r for r in requests if r.turn == 0), key=lambda r: (r.arrival_s, r.index)))
    ready: deque[tuple[WorkloadRequest, list[int], int]] = deque()  # later turns, due now: (request, prompt, reusable)
    due: dict[str, tuple[WorkloadRequest, float, int]] = {}
    first: dict[str, float] = {}
    done: list[RequestTiming] = []
    computed_prefix = 0  # the longest shared prefix an earlier request has computed
    hits_before = _prefix_hits(engine)
    steps = 0
    start = time.perf_counter()
    while pending or ready or due:
        now = time.perf_counter() - start
        while ready or (pending and _may_admit(arrival, pending[0], len(due), now)):
            if ready:
                request, prompt, reusable = ready.popleft()
            else:
                request = pending.popleft()
                prompt, reusable = list(request.prompt_token_ids), min(computed_prefix, request.shared_prefix_len)
            rid = f"w{request.index}"
            engine.add_request(rid, prompt, SamplingParams(**dict(request.sampling)))
            due[rid] = (request, now if arrival.concurrency is not None or request.turn else request.arrival_s, reusable)
        if not due:  # open loop, nothing in flight: wait for the next arrival
            time.sleep(max(0.0, pending[0].arrival_s - now))
            continue
        with span(tracer, "step", track="engine"):
            outputs = engine.step()
        steps += 1
        now = time.perf_counter() - start
        for out in outputs:
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = now  # its prompt has been computed
                computed_prefix = max(computed_prefix, due[out.request_id][0].shared_prefix_len)
            if out.finished:
                request, due_s, reusable = due.pop(out.request_id)
                history = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
                if (after := later.pop((request.conversation, request.turn + 1), None)) is not None:
                    # Everything but the last output token was computed (it was sampled, not fed).
                    ready.append((after, history + list(after.prompt_token_ids), len(history) - 1))
                done.append(RequestTiming(
                    index=request.index, prompt_len=len(out.prompt_token_ids),
                    num_output_tokens=len(out.outputs[0].token_ids),
                    due_s=due_s, first_token_s=first.pop(out.request_id, now), finish_s=now,
                    turn=request.turn, reusable_tokens=reusable,
                    prompt=tuple(out.prompt_token_ids), output=tuple(out.outputs[0].token_ids),
                ))
    hits_after = _prefix_hits(engine)
    return RunResult(wall_s=time.perf_counter() - start, num_steps=steps, requests=tuple(sorted(done, key=lambda r: r.index)),
                     prefix_hits=None if hits_before is None else hits_after - hits_before)


def _prefix_hits(engine) -> int | None:
    return engine.stats().prefix_hits if getattr(engine, "prefix_caching", None) else None


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
