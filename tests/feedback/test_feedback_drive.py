"""The in-process workload driver: closed loop keeps N in flight, timed arrivals wait for their
moment, and the metrics count what was generated."""

from __future__ import annotations

import pytest

from oxserve.engine.engine import LLMEngine
from oxserve.feedback.drive import PROMPT_MIN_TOKEN_ID, RUN_METRICS, run_workload
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



def test_conversations_send_each_turn_after_the_last_with_its_history(engine):
    """A later turn's prompt is the previous turn's prompt and output plus its own message,
    sent once that turn has finished; the prefix cache serves the history."""
    w = Workload.from_dict({"name": "chat", "num_requests": 12, "input_len": {"uniform": [3, 9]},
                            "output_len": {"uniform": [2, 5]}, "arrival": {"concurrency": 2},
                            "shared_prefix": {"length": 20}, "conversation": {"turns": 4},
                            "sampling": {"temperature": 0.0, "ignore_eos": True}})  # fmt: skip
    requests = w.requests(engine.model_config.vocab_size, min_token_id=PROMPT_MIN_TOKEN_ID)
    assert [(r.conversation, r.turn) for r in requests[:5]] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]
    assert requests[0].prompt_token_ids[:20] == requests[4].prompt_token_ids[:20], "a shared system prompt"
    assert requests[1].shared_prefix_len == 0 and len(requests[1].prompt_token_ids) <= 9, "a later turn holds its message"
    result = run_workload(engine, requests, w.arrival)
    by_index = {r.index: r for r in result.requests}
    for r in requests:
        if r.turn:
            previous, this = by_index[r.index - 1], by_index[r.index]
            assert this.prompt_len == previous.prompt_len + previous.num_output_tokens + len(r.prompt_token_ids)
            assert this.due_s >= previous.finish_s and this.reusable_tokens == this.prompt_len - len(r.prompt_token_ids) - 1
    m = result.metrics()
    assert m["ttft_later_turns_mean_s"] > 0 and m["later_turn_first_tokens_per_s"] == 1 / m["ttft_later_turns_mean_s"]
    assert 0.9 <= m["prefix_hit_rate"] <= 1.0, m
    assert set(m) == set(RUN_METRICS)  # a conversation with a prefix cache reports every metric there is
    for r in requests:  # what was sent and what came back, for the experiments' output checks
        this = by_index[r.index]
        assert len(this.prompt) == this.prompt_len and len(this.output) == this.num_output_tokens
        assert this.prompt[len(this.prompt) - len(r.prompt_token_ids):] == r.prompt_token_ids


def test_a_conversation_needs_whole_turns_and_a_system_prompt_length():
    base = {"name": "c", "input_len": 8, "output_len": 4, "conversation": {"turns": 3}}
    with pytest.raises(ValueError, match="multiple of conversation turns"):
        Workload.from_dict({**base, "num_requests": 7})
    with pytest.raises(ValueError, match="not a fraction"):
        Workload.from_dict({**base, "num_requests": 6, "shared_prefix": {"fraction": 0.5}})
    assert Workload.from_dict(Workload.from_dict({**base, "num_requests": 6}).to_dict()).conversation.turns == 3
