"""What stops the agent from fooling itself or being fooled, decided by the same code the
loop runs: the acceptance rule (`judge`) on experiments' statistics, and the first check of
every proposal (`check_action`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from oxserve.agent.actions import Action, check_action, needs_approval
from oxserve.agent.goal import goal_from_dict
from oxserve.agent.judge import judge
from oxserve.feedback.ledger import ExperimentRecord
from oxserve.feedback.stats import compare, more_pairs_needed

GOAL = goal_from_dict({
    "objective": {"workload": "smoke"}, "start": {"max_num_seqs": 1},
    "search_space": {"max_num_seqs": [1, 4, 8], "dtype": ["float32", "bfloat16"],
                     "speculative_config": [None, '{"method": "ngram", "num_speculative_tokens": 2}'],
                     "deterministic": [False, True]},
    "constraints": {"max": {"tpot_p90_s": 0.05}}, "risk": {"needs_approval": ["dtype"]}})


def record(a, b, *, passed=True, roofline=None, tpot_a=0.01, tpot_b=0.01, status="finished") -> ExperimentRecord:
    c = compare(a, b, roofline=roofline, n_resamples=2000)
    stats = {**c.to_dict(), "medians": {"A": {"tpot_p90_s": tpot_a}, "B": {"tpot_p90_s": tpot_b}}}
    return ExperimentRecord(1, "", "", status, "", {}, {}, "", "w", {}, {}, c.verdict, stats,
                            {"passed": passed, "max_divergence": 0.0 if passed else 0.3, "bound": 0.05},
                            None, None if status == "finished" else "worker crashed", ())


def a_a_experiment(rng, noise: float) -> ExperimentRecord:
    """An experiment between two identical configurations on a noisy machine, with the loop's
    pairs (4, more while the CI is wide, at most 6)."""
    a, b = [], []
    wanted = 4
    while wanted:
        a += list(100 * np.exp(rng.normal(0, noise, wanted)))
        b += list(100 * np.exp(rng.normal(0, noise, wanted)))
        wanted = more_pairs_needed(np.array(a), np.array(b), max_pairs=6, ci_width_threshold=0.04)
    return record(a, b)


def test_noise_is_not_accepted_a_a_false_accepts_stay_under_5_percent():
    """A/A experiments with no-op changes at ±5-15% run-to-run noise: a single experiment
    accepts about alpha/2 of them; the confirmation experiment the loop runs makes it rare."""
    rng = np.random.default_rng(0)
    n = 400
    single = confirmed = 0
    for k in range(n):
        noise = (0.05, 0.10, 0.15)[k % 3]
        if not judge(a_a_experiment(rng, noise), GOAL):
            single += 1
            confirmed += not judge(a_a_experiment(rng, noise), GOAL)
    assert single / n <= 0.05, single
    assert confirmed / n <= 0.01, confirmed


def test_a_real_gain_is_accepted_and_each_failure_is_named():
    rng = np.random.default_rng(1)
    a = 100 * np.exp(rng.normal(0, 0.03, 6))
    b = 130 * np.exp(rng.normal(0, 0.03, 6))
    assert judge(record(a, b), GOAL) == []
    assert any("quality gate failed" in r for r in judge(record(a, b, passed=False), GOAL))
    assert any(r.startswith("suspect") for r in judge(record(a, b, roofline=120.0), GOAL))  # faster than the hardware allows
    assert any("limit tpot_p90_s" in r for r in judge(record(a, b, tpot_b=0.2), GOAL))
    assert any(r.startswith("B slower") for r in judge(record(b, a), GOAL))
    assert "worker crashed" in judge(record(a, b, status="failed"), GOAL)[0]


def test_repairing_a_broken_limit_may_cost_a_little_speed_not_more():
    rng = np.random.default_rng(2)
    a = 100 * np.exp(rng.normal(0, 0.01, 6))
    assert judge(record(a, a * 0.97, tpot_a=0.2), GOAL) == []  # the incumbent breaks TPOT p90 <= 0.05, B keeps it
    assert "costs more than 5%" in judge(record(a, a * 0.85, tpot_a=0.2), GOAL)[0]
    noisy = 100 * np.exp(rng.normal(0, 0.2, 4))  # too noisy to call a 15% loss significant: still refused
    slower = record(noisy, noisy * 0.85 * np.exp(rng.normal(0, 0.2, 4)), tpot_a=0.2)
    assert slower.stats["median_ratio"] < 0.95 and "costs more than 5%" in judge(slower, GOAL)[0]
    assert judge(record(a, a * 0.97, tpot_a=0.2, tpot_b=0.1), GOAL)  # both break it: B must still be faster


@pytest.mark.parametrize("changes, problem", [
    ({}, "changes nothing"),
    ({"max_num_seqs": 1}, "already 1"),
    ({"max_num_seqs": 2}, "not among the allowed values"),
    ({"threads": 2}, "not in the goal's search space"),
    ({"cache_memory_gib": 64}, "not in the goal's search space"),
    ({"speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}', "deterministic": True},
     "not a valid engine configuration"),
])
def test_a_proposal_outside_the_goal_never_runs(changes, problem):
    problems = check_action(Action(changes, "", 1.2, "test"), GOAL, GOAL.start)
    assert any(problem in p for p in problems), problems


def test_a_nonsense_prediction_is_refused_and_risky_options_wait_for_a_person():
    assert any("predicted ratio" in p for p in check_action(Action({"max_num_seqs": 8}, "", float("nan"), "t"), GOAL, GOAL.start))
    assert check_action(Action({"max_num_seqs": 8}, "", 2.0, "t"), GOAL, GOAL.start) == []
    assert needs_approval(Action({"dtype": "bfloat16", "max_num_seqs": 8}, "", 2.0, "t"), GOAL) == ["dtype"]
    assert needs_approval(Action({"max_num_seqs": 8}, "", 2.0, "t"), GOAL) == []


def test_a_gain_won_by_slowing_the_baseline_is_refused_by_the_baseline_check():
    rng = np.random.default_rng(5)
    slowed_a, b = 60 * np.exp(rng.normal(0, 0.03, 6)), 100 * np.exp(rng.normal(0, 0.03, 6))
    won = record(slowed_a, b)
    assert judge(won, GOAL) == []  # on its own numbers it looks like a 1.67x win
    (reason,) = judge(won, GOAL, baseline_rate=100.0)  # but A ran at 0.6x of what it ran before
    assert reason.startswith("baseline check: A ran at") and "something slowed the baseline" in reason
    assert judge(won, GOAL, baseline_rate=80.0) == []  # within noise of its last rate: no objection


def test_the_output_check_is_named_apart_from_the_quality_gate():
    rng = np.random.default_rng(6)
    r = record(100 * np.exp(rng.normal(0, 0.03, 6)), 150 * np.exp(rng.normal(0, 0.03, 6)))
    r = dataclasses.replace(r, quality={"passed": False, "gate_passed": True, "max_divergence": 0.0, "bound": 0.05,
                                        "outputs": {"warm_up": {"passed": False, "shortfall": 2.5, "bound": 0.25}}})
    (reason,) = judge(r, GOAL)
    assert reason == ("output check failed (warm_up): B's workload outputs are 2.5 nats/token less likely than "
                      "A's under A (bound 0.25)")


def test_a_change_that_failed_the_quality_gate_is_never_retried_whatever_comes_with_it():
    from oxserve.agent.policy import AgentState, Outcome

    bf16 = Action({"dtype": "bfloat16"}, "r", 1.2, "rule")
    history = [Outcome(bf16, {"max_num_seqs": 1}, False, ("quality gate failed",), (1,), 1.3, 10.0, True)]
    state = AgentState(GOAL, {"max_num_seqs": 4}, 10.0, None, history)
    assert state.tried(bf16)  # against another incumbent, still refused
    assert state.tried(Action({"dtype": "bfloat16", "max_num_seqs": 8}, "r", 1.5, "rule"))  # bundled
    assert not state.tried(Action({"max_num_seqs": 8}, "r", 1.5, "rule"))
    assert not state.tried(Action({"dtype": "float32"}, "r", 1.5, "rule"))
