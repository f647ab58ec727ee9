"""The experiments' output check and tree check, on numbers and files made by hand."""

from __future__ import annotations

import numpy as np
import pytest

from oxserve.experiment.launch import WorkerError
from oxserve.experiment.procedure import TreeGuard
from oxserve.experiment.quality import GREEDY_MARGIN, compare_outputs


def test_outputs_as_likely_as_the_references_pass_and_far_less_likely_ones_fail():
    rng = np.random.default_rng(0)
    ref = [list(rng.normal(-1.0, 0.3, 12)) for _ in range(8)]
    same = compare_outputs(ref, ref, 0.25)
    assert same["passed"] and same["shortfall"] == 0.0 and same["tokens"] == 96
    made_up = compare_outputs(ref, [list(rng.normal(-6.0, 0.3, 12)) for _ in range(8)], 0.25)
    assert not made_up["passed"] and made_up["shortfall"] > 4


def test_sampled_outputs_get_the_bound_plus_their_standard_error():
    rng = np.random.default_rng(1)
    ref = [list(rng.normal(rng.normal(-2.0, 1.0), 0.5, 16)) for _ in range(6)]  # requests differ a lot
    cand = [list(rng.normal(rng.normal(-2.4, 1.0), 0.5, 16)) for _ in range(6)]
    r = compare_outputs(ref, cand, 0.25)
    assert r["allowed_shortfall"] > 0.25 + 0.3  # three standard errors over 6 requests
    assert r["passed"] == (r["shortfall"] <= r["allowed_shortfall"])
    assert r["passed"] and r["shortfall"] > 0.25  # past the bound alone: the standard error lets it pass


def test_a_greedy_output_that_leaves_the_references_path_far_from_a_tie_fails():
    a_tokens, b_tokens = [[5, 6, 7, 8]], [[5, 6, 9, 9]]
    a_scores = [[-0.1, -0.2, -0.3, -0.1]]  # A's own greedy choices, under A
    near_tie = [[-0.1, -0.2, -0.3 - GREEDY_MARGIN / 2, -0.1]]  # B's token 9 at the first difference
    far = [[-0.1, -0.2, -0.3 - 3 * GREEDY_MARGIN, -0.1]]
    assert compare_outputs(a_scores, near_tie, 5.0, [True], a_tokens, b_tokens)["passed"]
    r = compare_outputs(a_scores, far, 5.0, [True], a_tokens, b_tokens)  # the mean alone would pass it
    assert not r["passed"] and r["worst_greedy_margin"] == pytest.approx(3 * GREEDY_MARGIN)
    assert compare_outputs(a_scores, far, 5.0, [False], a_tokens, b_tokens)["passed"]  # sampled: no path to keep


def test_an_arms_files_may_change_only_while_it_runs(tmp_path):
    tree = tmp_path / "oxserve"
    (tree / "__pycache__").mkdir(parents=True)
    (tree / "engine.py").write_text("x = 1\n")
    guard = TreeGuard()
    guard.check("B", [tree])  # nothing recorded yet
    guard.record([tree])
    (tree / "__pycache__" / "engine.pyc").write_bytes(b"bytecode")  # not watched
    guard.check("B", [tree])
    (tree / "engine.py").write_text("x = 2\n")
    with pytest.raises(WorkerError, match=r"arm B: .*oxserve changed while it was not running \(tree check\)"):
        guard.check("B", [tree])
