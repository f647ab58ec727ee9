"""Goal files: what the agent may search, checked on load against the engine's own options."""

from __future__ import annotations

from pathlib import Path

import pytest

from oxserve.agent.goal import goal_from_dict, load_goal

REPO = Path(__file__).resolve().parents[2]


def goal(**over) -> dict:
    base = {"objective": {"workload": "smoke"}, "search_space": {"max_num_seqs": [1, 4]}}
    return {**base, **over}


def test_the_shipped_goals_load():
    naive = load_goal(REPO / "agent" / "from_naive.yaml")
    assert naive.start["max_num_seqs"] == 1 and naive.start["dtype"] == "float32"
    assert naive.held_out is not None and naive.held_out.name != naive.workload.name
    defaults = load_goal(REPO / "agent" / "from_defaults.yaml")
    assert {"quantization", "kv_cache_dtype"} <= defaults.needs_approval
    code = load_goal(REPO / "agent" / "code_patches.yaml")
    assert "code" in code.needs_approval and "oxserve/engine/*" in code.code.allowed and code.policy == "llm"


@pytest.mark.parametrize("data, message", [
    (goal(budgets={}), "unknown key"),
    (goal(search_space={"max_num_seq": [1]}), "unknown engine option 'max_num_seq'"),
    (goal(search_space={"dtype": ["float32", "float8"]}), "value 'float8' is not valid"),
    (goal(search_space={"max_num_seqs": []}), "non-empty list"),
    (goal(search_space={"model": ["/tmp/x"]}), "is fixed"),
    (goal(search_space={"threads": [1, 2]}, base_options={"threads": 1}), "is fixed"),
    (goal(start={"max_num_seqs": 8}), "not among search_space.max_num_seqs"),
    (goal(objective={"workload": "smoke", "held_out": "smoke"}), "must differ"),
    (goal(objective={"workload": "smoke", "metric": "ttft_p50_s"}), "must be a rate"),
    (goal(objective={"workload": "smoke", "metric": "output_token_per_s"}), "not a metric runs report"),
    (goal(constraints={"max": {"tpot_p99_s": 0.1}}), "tpot_p99_s not among the metrics"),
    (goal(experiment={"pairs": 3}), "can never reach Mann-Whitney p < 0.05"),
    (goal(policy="random"), "policy must be one of"),
    (goal(risk={"needs_approval": ["quantisation"]}), "unknown option"),
    ({"objective": {"workload": "smoke"}}, "search_space is required"),
    (goal(code={"allowed": []}), "code.allowed must be a non-empty list"),
    (goal(code={"allowed": ["oxserve/engine/*"], "patch": []}), "code: unknown key"),
    (goal(code={"allowed": ["oxserve/engine/*"], "patches": [{"file": "no-such.diff"}]}), "cannot read"),
    (goal(start={"speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}', "deterministic": True}),
     "deterministic"),
])
def test_a_bad_goal_is_refused_naming_the_key(data, message):
    with pytest.raises(ValueError, match=message):
        goal_from_dict(data)


def test_a_plan_in_the_search_space_is_a_file_or_a_sensitivity_marker(tmp_path):
    (tmp_path / "plan.yaml").write_text("layers: {0: {weights: w8a8}}\n")
    g = goal_from_dict(goal(search_space={"quantization_plan": [None, "plan.yaml", "sensitivity@0.01"]}), tmp_path)
    assert g.search_space["quantization_plan"] == (None, str((tmp_path / "plan.yaml").resolve()), "sensitivity@0.01")
    for bad, message in [("sensitivity@lots", "a plan marker is sensitivity@"), ("sensitivity@0", "must be > 0"),
                         ("no-such-plan.yaml", "neither a plan file nor sensitivity@")]:
        with pytest.raises(ValueError, match=message):
            goal_from_dict(goal(search_space={"quantization_plan": [None, bad]}), tmp_path)


def test_a_code_section_makes_patches_actions_with_queued_candidates(tmp_path):
    (tmp_path / "p.diff").write_text("--- a/oxserve/engine/x.py\n+++ b/oxserve/engine/x.py\n")
    g = goal_from_dict({"objective": {"workload": "smoke"}, "risk": {"needs_approval": ["code"]},
                        "code": {"allowed": ["oxserve/engine/*"], "tests": ["tests/test_sampler.py"],
                                 "patches": [{"file": "p.diff", "rationale": "fewer copies", "predicted_ratio": 1.1}]}},
                       tmp_path)
    assert g.search_space == {} and g.needs_approval == {"code"} and g.code.tests == ("tests/test_sampler.py",)
    (candidate,) = g.code.candidates
    assert (candidate.rationale, candidate.predicted_ratio, candidate.name) == ("fewer copies", 1.1, "p.diff")


def test_inline_workloads_and_option_spellings(tmp_path):
    (tmp_path / "start.yaml").write_text("scheduler: {max-num-seqs: 1}\n")
    g = goal_from_dict(goal(start="start.yaml", objective={
        "workload": {"name": "w", "num_requests": 2, "input_len": 8, "output_len": 4},
        "held_out": {"name": "h", "num_requests": 3, "input_len": 8, "output_len": 4}},
        constraints={"max": {"tpot_p90_s": 0.5}}, risk={"needs_approval": ["max-num-seqs"]}), tmp_path)
    assert g.start == {"max_num_seqs": 1} and g.limits == {"tpot_p90_s": 0.5}
    assert g.needs_approval == {"max_num_seqs"} and g.workload.name == "w" and g.held_out.num_requests == 3
