"""The rules policy on a real profile of the tiny checkpoint: each remedy is proposed when its
diagnosis holds, not otherwise, with the prediction its cost model gives."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from oxserve.agent.diagnosis import diagnose
from oxserve.agent.goal import goal_from_dict
from oxserve.agent.policies import rules
from oxserve.agent.policies.rules import (MIN_GAIN, REPLAY_OVERHEAD_CUT, Context, RulesPolicy, amdahl,
                                          captured_steps, ngram_speculation, sensitivity_plan)
from oxserve.agent.policy import AgentState

WORKLOAD = {"name": "eight", "num_requests": 8, "input_len": {"uniform": [24, 40]}, "output_len": 12,
            "arrival": {"concurrency": 8}, "shared_prefix": {"fraction": 0.5},
            "sampling": {"temperature": 0.0, "ignore_eos": True}}


def goal(model, **over):
    return goal_from_dict({
        "objective": {"workload": WORKLOAD},
        "start": {"max_num_seqs": 1, "dtype": "float32", "max_num_batched_tokens": 16, "enable_prefix_caching": False},
        "base_options": {"model": str(model), "cache_memory_gib": 0.05, "threads": 1},
        "search_space": {"max_num_seqs": [1, 4, 8], "dtype": ["float32", "bfloat16"],
                         "max_num_batched_tokens": [8, 16, 256], "enable_prefix_caching": [False, True]},
        **over})


@pytest.fixture(scope="module")
def naive(tiny_model_dir, data_dir, tmp_path_factory):
    """The profile of one sequence at a time, 16-token prefill chunks, fp32, no prefix cache."""
    g = goal(tiny_model_dir)
    return g, diagnose({**g.base_options, **g.start}, g.workload, tmp_path_factory.mktemp("profile"))


def test_the_diagnosis_reads_the_profile(naive):
    _, d = naive
    assert d.decode_batch == pytest.approx(1.0)  # one sequence at a time
    assert sum(d.phase_share.values()) == pytest.approx(1.0)
    assert 8 <= d.phase_tokens["prefill"] <= 16  # chunks of the 16-token budget
    assert d.headline and d.gaps and d.op_share["lm_head"] > 0 and 0 < d.decode_roofline["moe.experts"]


def test_remedies_follow_their_diagnoses(naive):
    g, d = naive
    actions = {a.origin: a for a in RulesPolicy().propose(AgentState(g, g.start, None, d))}
    batch = actions["rules:batch_limit"]
    assert batch.changes == {"max_num_seqs": 8} and batch.predicted_ratio > 1.5
    assert actions["rules:prefill_budget"].changes == {"max_num_batched_tokens": 256}
    assert actions["rules:prefill_budget"].predicted_ratio > 1.0
    assert actions["rules:prefix_caching"].changes == {"enable_prefix_caching": True}
    bf16 = actions["rules:bf16_weights"]
    assert bf16.evidence["bytes_ratio"] == pytest.approx(2.0, rel=0.1) and 1.0 < bf16.predicted_ratio < 2.0
    ranked = RulesPolicy().propose(AgentState(g, g.start, None, d))
    assert ranked[0].origin == "rules:batch_limit"  # the largest gain per minute of experiment

    # The same numbers with a limit that does not bind, and a prefix cache that is on: no such remedy.
    roomy = {**g.start, "max_num_seqs": 8, "enable_prefix_caching": True, "max_num_batched_tokens": 256}
    origins = {a.origin for a in RulesPolicy().propose(AgentState(g, roomy, None, d))}
    assert not origins & {"rules:batch_limit", "rules:prefix_caching", "rules:prefill_budget"}


def test_a_broken_latency_limit_comes_first_even_at_a_predicted_cost(naive, tiny_model_dir):
    _, d = naive
    g = goal(tiny_model_dir, constraints={"max": {"tpot_p90_s": 1e-6}})
    first = RulesPolicy().propose(AgentState(g, g.start, None, d))[0]
    assert first.origin == "rules:latency_limit" and first.changes == {"max_num_batched_tokens": 8}
    assert first.predicted_ratio < 1.0 and first.evidence["repairs"] == ["tpot_p90_s"]


def test_amdahl():
    assert amdahl(0.5, 2.0) == pytest.approx(1 / 0.75)
    assert amdahl(0.0, 10.0) == 1.0 and amdahl(1.0, 3.0) == pytest.approx(3.0)



def test_a_sensitivity_plan_is_proposed_where_decode_dominates_bounded_by_w8a8s_bytes(naive, tiny_model_dir, monkeypatch):
    g, d = naive
    with_plans = goal(tiny_model_dir, search_space={**{k: list(v) for k, v in g.search_space.items()},
                                                    "quantization_plan": [None, "sensitivity@0.05", "sensitivity@0.01"]})
    state, policy = AgentState(with_plans, g.start, None, d), RulesPolicy()
    options = with_plans.current_options(g.start)
    context = Context(state, d, options, policy._step_bytes(state), policy._bench(state, options))
    (plan,) = sensitivity_plan(context)
    assert plan.changes == {"quantization_plan": "sensitivity@0.01"}  # the most careful budget first
    w8a8 = context.bytes_ratio({"quantization": "w8a8"})
    assert plan.evidence["bytes_ratio"] == pytest.approx(w8a8, abs=1e-4) and "at most" in plan.rationale
    assert plan.predicted_ratio == pytest.approx(1 + (w8a8 - 1) * context.byte_fraction(), abs=1e-3)
    # On this tiny model its bound is under the 1% a remedy must promise: the policy does not propose it.
    assert (plan.predicted_ratio > 1 + MIN_GAIN) == any(a.origin == "rules:sensitivity_plan" for a in policy.propose(state))
    # With a threshold under its bound, the policy does propose it: the rule is in the catalogue.
    monkeypatch.setattr(rules, "MIN_GAIN", (plan.predicted_ratio - 1) / 2)
    assert any(a.origin == "rules:sensitivity_plan" for a in RulesPolicy().propose(state))
    assert sensitivity_plan(Context(AgentState(g, g.start, None, d), d, options, policy._step_bytes(state),
                                    policy._bench(state, options))) == []  # no marker in the space


def _context(g, incumbent, d):
    state, policy = AgentState(g, incumbent, None, d), RulesPolicy()
    options = g.current_options(incumbent)
    return Context(state, d, options, policy._step_bytes(state), policy._bench(state, options))


def test_eager_decode_steps_dominated_by_overhead_get_captured_steps(naive, tiny_model_dir, tmp_path):
    g0, _ = naive
    g = goal(tiny_model_dir, search_space={**{k: list(v) for k, v in g0.search_space.items()},
                                           "enforce_eager": [True, False]})
    eager = {**g.start, "enforce_eager": True}
    d = diagnose({**g.base_options, **eager}, g.workload, tmp_path / "eager")  # eager steps, as profiled
    (action,) = captured_steps(_context(g, eager, d))  # a tiny model's eager step is mostly overhead
    assert action.changes == {"enforce_eager": False} and action.predicted_ratio > 1 + MIN_GAIN
    assert action.evidence["overhead_us"] > 0 and action.evidence["per_token_us"] > 0
    assert any(a.origin == "rules:captured_steps" for a in RulesPolicy().propose(AgentState(g, eager, None, d)))
    assert captured_steps(_context(g, g.start, d)) == []  # steps are captured already
    assert captured_steps(_context(g0, eager, d)) == []  # not in the goal's search space

    # By hand: decode steps of 10 tokens take 4000 µs, prefill steps of 100 take 13000 µs, so
    # a token costs 100 µs and a step 3000 µs of overhead (75% of a decode step); replaying
    # halves the overhead: 4000 / (1500 + 1000) = 1.6 on decode, all of the run here.
    assert REPLAY_OVERHEAD_CUT == 0.5
    steps = dict(phase_step_us={"decode": 4000.0, "prefill": 13000.0}, phase_tokens={"decode": 10.0, "prefill": 100.0},
                 decode_batch=10.0, phase_share={"decode": 1.0})
    (action,) = captured_steps(_context(g, eager, dataclasses.replace(d, **steps)))
    assert action.predicted_ratio == pytest.approx(1.6, abs=1e-3)
    assert action.evidence["overhead_us"] == pytest.approx(3000) and action.evidence["per_token_us"] == pytest.approx(100)
    # Half the run in decode: 1 / (0.5 + 0.5 / 1.6).
    (action,) = captured_steps(_context(g, eager, dataclasses.replace(d, **{**steps, "phase_share": {"decode": 0.5, "prefill": 0.5}})))
    assert action.predicted_ratio == pytest.approx(1 / (0.5 + 0.5 / 1.6), abs=1e-3)
    # Steps of 40 tokens: 3000 of 7000 µs is overhead (43%); 7000 / 5500.
    (action,) = captured_steps(_context(g, eager, dataclasses.replace(d, **{**steps, "decode_batch": 40.0})))
    assert action.predicted_ratio == pytest.approx(7000 / 5500, abs=1e-3)
    # Steps of 80 tokens: 3000 of 11000 µs (27%) is overhead: not worth it.
    assert captured_steps(_context(g, eager, dataclasses.replace(d, **{**steps, "decode_batch": 80.0}))) == []


def test_outputs_that_repeat_their_prompts_get_ngram_speculation(naive, tiny_model_dir):
    g0, d = naive
    assert len(d.sequences) == 8 and all(len(output) == 12 for _, output in d.sequences)  # from sequences.json
    configs = [None, json.dumps({"method": "ngram", "num_speculative_tokens": 2}),
               json.dumps({"method": "ngram", "num_speculative_tokens": 4}),
               json.dumps({"method": "mtp", "num_speculative_tokens": 2})]
    g = goal(tiny_model_dir, search_space={**{k: list(v) for k, v in g0.search_space.items()}, "speculative_config": configs})
    rng = random.Random(0)
    cycles = [[rng.randrange(100, 900) for _ in range(7)] for _ in range(8)]
    repeating = dataclasses.replace(d, sequences=tuple((c * 4, c * 3) for c in cycles))
    (action,) = ngram_speculation(_context(g, g.start, repeating))
    assert action.changes == {"speculative_config": configs[2]}  # all drafts kept: the deeper one wins
    assert action.evidence["acceptance_rate"] == 1.0 and action.evidence["tokens_per_step"] > 4
    assert action.predicted_ratio > 1 + MIN_GAIN
    fresh = dataclasses.replace(d, sequences=tuple((c, list(range(1000 + 20 * i, 1014 + 20 * i))) for i, c in enumerate(cycles)))
    assert ngram_speculation(_context(g, g.start, fresh)) == []  # nothing to look up: no drafts at all
    assert ngram_speculation(_context(g, {**g.start, "speculative_config": configs[1]}, repeating)) == []
    mtp_only = goal(tiny_model_dir, search_space={"speculative_config": [configs[0], configs[3]]})
    assert ngram_speculation(_context(mtp_only, mtp_only.start, repeating)) == []  # MTP drafts are not lookups


def test_a_cheap_check_that_fails_drops_its_remedy_and_says_why(naive, tiny_model_dir, monkeypatch):
    g0, d = naive
    g = goal(tiny_model_dir, search_space={**{k: list(v) for k, v in g0.search_space.items()},
                                           "linear_kernel": ["torch", "auto"]})
    unpacked = {**g.start, "linear_kernel": "torch"}
    monkeypatch.setattr(rules, "BENCH_TIMEOUT_S", 0.05)  # `bench kernels` cannot finish in that
    policy = RulesPolicy()
    proposed = policy.propose(AgentState(g, unpacked, None, d))
    assert proposed and not any(a.origin == "rules:packed_linears" for a in proposed)  # the others still come
    (entry,) = policy.rejected
    assert "cheap check failed" in entry["reason"] and "took over 0.05 s" in entry["reason"]
    assert entry["check"] == {"op": "lm_head", "batch": 1}
    policy.propose(AgentState(g, unpacked, None, d))
    assert len(policy.rejected) == 1  # not run (nor journaled) twice
