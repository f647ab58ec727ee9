"""The in-process workload driver: closed loop keeps N in flight, timed arrivals wait for their
moment, and the metrics count what was generated."""

from __future__ import annotations

import pytest

from oxserve.engine.engine import LLMEngine
from oxserve.feedback.drive import PROMPT_MIN_TOKEN_ID, run_workload
from oxserve.options import engine_config
from oxserve.feedback.workload import Workload
from oxserve.profiling.spans import group_spans
from oxserve.telemetry import Tracer


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(engine_config({"model": str(tiny_model_dir), "dtype": "float32", "cache_memory_gib": 0.05}))


def workload(arrival: dict, n: int = 6) -> Workload:
    return Workload.from_dict({"name": "t", "num_requests": n, "input_len": {"uniform": [4, 12]},
                               "output_len": {"uniform": [2, 6]}, "arrival": arrival,
                               "sampling": {"temperature": 0.0, "ignore_eos": True}})


def test_closed_loop_keeps_at_most_concurrency_in_flight(engine):
    w = workload({"concurrency": 2})
    requests = w.requests(engine.model_config.vocab_size, min_token_id=PROMPT_MIN_TOKEN_ID)
    tracer = Tracer()
    engine.runner.tracer = tracer
    try:
        result = run_workload(engine, requests, w.arrival, tracer)
    finally:
        engine.runner.tracer = None
    steps = group_spans(tracer.spans)
    assert len(steps) == result.num_steps
    assert max(s.num_requests for s in steps) == 2
    m = result.metrics()
    assert m["num_requests"] == 6 and m["num_output_tokens"] == sum(r.output_len for r in requests)
    assert m["output_tokens_per_s"] == pytest.approx(m["num_output_tokens"] / m["total_time_s"])
    assert 0 < m["ttft_p50_s"] <= m["total_time_s"] and m["tpot_mean_s"] > 0


def test_timed_arrivals_wait_for_their_offset(engine):
    w = workload({"request_rate": 40.0})
    requests = w.requests(engine.model_config.vocab_size, min_token_id=PROMPT_MIN_TOKEN_ID)
    result = run_workload(engine, requests, w.arrival)
    assert result.wall_s >= requests[-1].arrival_s
    for timing, request in zip(result.requests, requests, strict=True):
        assert timing.due_s == request.arrival_s  # latency counts from when it was due
        assert timing.first_token_s >= request.arrival_s and timing.ttft_s > 0
        assert timing.num_output_tokens == request.output_len

