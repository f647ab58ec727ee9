"""The speculation guard: per-request draft depth from acceptance, per-batch payoff."""

from __future__ import annotations

import random

from oxserve.engine.interface import NEW_SHAPE, SETTLING, STEADY
from oxserve.engine.request import Request
from oxserve.sampling_params import SamplingParams
from oxserve.engine.spec_guard import (
    EXPLORE,
    EXPLORE_DEAR,
    EXPLORE_DEAR_MAX,
    FIRST_PLAIN,
    KEEP_FLOOR,
    MAX_DEPTH,
    MIN_FLOOR,
    WARMING_PROBES,
    DraftCost,
    draft_depth,
    record_verify,
)


def _request() -> Request:
    return Request("r", [1, 2, 3], SamplingParams(), 1000)


def test_depth_follows_the_acceptance_estimate():
    rng = random.Random()
    k, floor = rng.randrange(2, 8), rng.uniform(MIN_FLOOR, 0.5)
    request = _request()
    alpha = rng.uniform(0.55, 0.9)
    estimates = []
    for i in range(300):  # verifies of depth-d drafts, each kept with chance alpha in a row
        d = max(1, draft_depth(request, k, floor))
        kept = next((j for j in range(d) if rng.random() >= alpha), d)
        record_verify(request, d, kept)
        if i >= 100:
            estimates.append(request.draft_hits / request.draft_trials)
    assert abs(sum(estimates) / len(estimates) - alpha) < 0.15  # 0.12 at worst in 20,000 trials
    estimate, depth = request.draft_hits / request.draft_trials, draft_depth(request, k, floor)
    if estimate >= floor:  # the deepest draft is worth its row, one more would not be
        assert 1 <= depth <= k
        assert estimate**depth >= floor or depth == 1
        assert estimate ** (depth + 1) < floor or depth == k
    else:
        assert depth == 0


def test_depth_is_zero_when_drafts_are_always_rejected():
    request = _request()
    assert draft_depth(request, 4, KEEP_FLOOR) == 4  # the prior: a new request drafts k
    for _ in range(13):  # 0.75 -> 0.587 -> ... -> 0.090
        record_verify(request, max(1, draft_depth(request, 4, MIN_FLOOR)), 0)
    assert draft_depth(request, 4, MIN_FLOOR) == 0


def test_cost_is_measured_per_batch_size_and_stops_drafting_where_rows_are_dear():
    cost = DraftCost()
    assert all(cost.budget(1) is None for _ in range(2 * EXPLORE))  # no plain step measured: nothing to compare rows with
    cost = DraftCost()
    cost.observe(1, 0, 0.010)
    budgets = [cost.budget(1) for _ in range(2 * EXPLORE)]
    plain = [i for i, b in enumerate(budgets) if b is None]
    assert plain == [*range(FIRST_PLAIN)]  # plain: the step the cost is relative to
    assert all(b == (KEEP_FLOOR, 1) for b in budgets if b is not None)  # not measured yet: the cheapest probe
    for _ in range(60):  # batch 1: 10 ms plain, 13 ms with 3 drafts -> a row costs 0.1 of a step
        cost.observe(1, 0, 0.010)
        cost.observe(1, 3, 0.013)
    assert abs(cost.row_cost[1] - 0.1) < 1e-6
    assert cost.budget(1) in (None, (max(MIN_FLOOR, 0.1), MAX_DEPTH)) and not cost.dear(1)
    for _ in range(60):  # batch 64: 100 ms plain, 240 ms with 64 drafts -> a row costs 1.4 steps of a request
        cost.observe(64, 0, 0.100)
        cost.observe(64, 64, 0.240)
    budgets = [cost.budget(64) for _ in range(8 * EXPLORE_DEAR_MAX)]
    probes = [i for i, b in enumerate(budgets) if b is not None]
    assert all(budgets[i] == (KEEP_FLOOR, 1) for i in probes)  # one draft per request
    # Rows are dear: rarer probes, each finding them dear again, down to one in EXPLORE_DEAR_MAX.
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[0] == 2 * EXPLORE_DEAR and gaps == sorted(gaps) and gaps[-1] == gaps[-2] == EXPLORE_DEAR_MAX
    assert 1 not in cost.row_cost or cost.row_cost[1] < 1  # buckets are separate
    assert cost.dear(64) and cost.dear(127) and not cost.dear(1) and not cost.dear(8)  # (8: not measured)


def test_rows_that_come_down_in_cost_are_noticed_and_drafted_again():
    cost = DraftCost()
    for _ in range(60):  # batch 4: 20 ms plain, 44 ms with 4 drafts -> a row costs 1.2 steps of a request
        cost.observe(4, 0, 0.020)
        cost.observe(4, 4, 0.044)
    before = [cost.budget(4) for _ in range(4 * EXPLORE_DEAR_MAX)]
    assert sum(b is not None for b in before) < 4 * EXPLORE_DEAR_MAX / EXPLORE_DEAR
    for _ in range(60):  # the machine freed up: 22 ms with 4 drafts -> 0.1 of a step
        cost.observe(4, 0, 0.020)
        cost.observe(4, 4, 0.022)
    after = [cost.budget(4) for _ in range(2 * EXPLORE)]
    assert sum(b is None for b in after) <= 2 and all(b[1] == MAX_DEPTH for b in after if b is not None)
    assert not cost.dear(4)


def test_a_shapes_first_steps_count_only_where_shapes_never_recur():
    """A captured shape's first steps cost several replays each: eager where it is met first,
    then recording, then a first replay that builds its plan. A batch size's first probes are
    such steps by nature, and charging them would stop drafting for thousands of steps. Once a
    replayed step has measured a row, steps of shapes met first count (where verify shapes
    keep changing, eager steps are what drafting costs); recordings and first replays never."""
    cost = DraftCost()
    for novelty in (NEW_SHAPE, SETTLING, SETTLING):
        cost.observe(8, 0, 0.200, novelty)  # the plain shape's own first steps: no measure of it
    assert cost.plain_s == {}
    for _ in range(3):
        cost.observe(8, 0, 0.010)
    for novelty in (NEW_SHAPE, SETTLING, SETTLING):
        cost.observe(8, 8, 0.060, novelty)
    assert cost.row_cost == {}
    cost.observe(8, 8, 0.012)  # replayed: a row costs 0.2 of a request's step
    assert abs(cost.row_cost[4] - 0.2) < 1e-9
    assert [cost.budget(8) is not None for _ in range(FIRST_PLAIN + 1)][-1]  # past its first plain steps: drafts
    for _ in range(30):  # recurring shapes settling: never a measure
        cost.observe(8, 8, 0.050, SETTLING)
    assert abs(cost.row_cost[4] - 0.2) < 1e-9
    for _ in range(30):  # shapes that never recur: eager steps at 5x the plain step
        cost.observe(8, 8, 0.050, NEW_SHAPE)
    assert cost.row_cost[4] > 1.0
    assert sum(cost.budget(8) is not None for _ in range(EXPLORE_DEAR - 1)) == 0  # drafting stopped
    cost = DraftCost()  # probes whose shapes never replay: past WARMING_PROBES, they are the measure
    cost.observe(8, 0, 0.010)
    for _ in range(WARMING_PROBES):
        cost.observe(8, 8, 0.050, NEW_SHAPE)
    assert cost.row_cost == {}
    cost.observe(8, 8, 0.050, NEW_SHAPE)
    assert cost.row_cost[4] > 1.0


def test_the_guard_first_measures_rows_on_a_replayed_step(monkeypatch):
    """Through the engine, with captured steps and the guard free: the verify steps that ran
    eagerly before their shape was replayed do not set the guard's first measure of a row."""
    from oxserve import LLM

    events = []
    observe = DraftCost.observe

    def noting(self, decodes, draft_rows, seconds, novelty=STEADY):
        measured = bool(self.row_cost)
        observe(self, decodes, draft_rows, seconds, novelty)
        events.append((draft_rows, novelty != STEADY, measured, bool(self.row_cost)))

    monkeypatch.setattr(DraftCost, "observe", noting)
    llm = LLM(dtype="bfloat16", max_num_seqs=1, speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    try:  # a prompt that repeats itself: the lookup drafts from the first decode on
        llm.generate([{"prompt_token_ids": list(range(40, 60)) * 6}],
                     SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    finally:
        llm.close()
    assert any(rows and warming for rows, warming, _, _ in events)  # verify shapes were met anew
    first = next(e for e in events if e[3] and not e[2])  # the step that set the first measure
    assert first[0] > 0 and not first[1]
