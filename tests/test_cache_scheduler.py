"""Block/slot bookkeeping and scheduling, on CPU, without a model."""

from __future__ import annotations

import pickle
import random

import pytest

from oxserve.cache.manager import CacheManager, IdPool
from oxserve.config import SchedulerConfig
from oxserve.engine.interface import STEADY, ModelRunnerOutput, SchedulerOutput
from oxserve.engine.request import Request, RequestStatus
from oxserve.engine.scheduler import Scheduler
from oxserve.sampling_params import RequestOutputKind, SamplingParams


def test_id_pool_allocates_distinct_ids_and_takes_them_back():
    pool = IdPool(8, "cache block")
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a + b)) == 8 and pool.num_free == 0
    with pytest.raises(RuntimeError, match="cache block"):
        pool.allocate(1)
    pool.free(a)
    assert pool.num_free == 3
    assert set(pool.allocate(3)) == set(a)
    with pytest.raises(ValueError, match="at least one"):
        IdPool(0, "state slot")


def test_cache_manager_grows_by_whole_blocks():
    cache = CacheManager(num_blocks=10, block_size=4, num_slots=2)
    cache.grow("a", 1)
    assert len(cache.blocks_of("a")) == 1
    cache.grow("a", 4)
    assert len(cache.blocks_of("a")) == 1
    cache.grow("a", 5)
    assert len(cache.blocks_of("a")) == 2
    assert cache.extra_blocks_needed("a", 40) == 8
    assert not cache.can_grow("a", 41)
    cache.grow("b", 3)
    assert not cache.can_grow("c", 1), "no third slot"
    cache.release("a")
    cache.release("b")
    assert cache.blocks.num_free == 10 and cache.slots.num_free == 2 and cache.num_holders == 0


def _request(i: int, prompt_len: int, max_tokens: int, **params) -> Request:
    return Request(
        request_id=f"r{i}",
        prompt_token_ids=list(range(prompt_len)),
        params=SamplingParams(max_tokens=max_tokens, **params),
        max_total_tokens=10_000,
    )


def _sample_all(out: SchedulerOutput, token: int = 1) -> ModelRunnerOutput:
    """What a runner returns: one token for every request that samples this step."""
    sampling = [s.request_id for s in out.scheduled if s.samples]
    return ModelRunnerOutput(sampling, [[token] for _ in sampling], [None] * len(sampling))


class RunnerView:
    """The block tables a runner rebuilds from the plain scheduler outputs alone."""

    def __init__(self):
        self.tables: dict[str, list[int]] = {}

    def apply(self, out: SchedulerOutput) -> None:
        for rid in out.finished_request_ids:
            self.tables.pop(rid, None)
        for new in out.new_requests:
            self.tables[new.request_id] = []
        for s in out.scheduled:
            self.tables[s.request_id] += s.new_block_ids


def _step_seconds(out: SchedulerOutput) -> float:
    """A synthetic cost: fixed overhead, per decode, per prefill token (as a CPU step is)."""
    decodes = sum(1 for s in out.scheduled if s.is_decode)
    return 0.02 + 0.002 * decodes + 0.0004 * (out.num_tokens - out.num_decode_tokens)


def _check_invariants(scheduler: Scheduler, cache: CacheManager, view: RunnerView) -> None:
    held = [b for r in scheduler.running for b in cache.blocks_of(r.request_id)]
    assert len(held) == len(set(held)), "a block is held twice"
    assert len(held) + cache.blocks.num_free == cache.blocks.size, "blocks leaked"
    assert cache.num_holders == len(scheduler.running)
    assert cache.slots.num_free + len(scheduler.running) == cache.slots.size
    for r in scheduler.waiting:
        assert not cache.blocks_of(r.request_id) and r.num_computed_tokens == 0
    for r in scheduler.running:  # the runner's tables agree with the cache's
        assert view.tables.get(r.request_id, []) == cache.blocks_of(r.request_id)


def _simulate(scheduler: Scheduler, cache: CacheManager, requests: list[Request], rng: random.Random) -> int:
    """Drive the scheduler the way the engine does; abort some requests on the way."""
    pending = list(requests)
    view = RunnerView()
    steps = 0
    while pending or scheduler.has_unfinished():
        for _ in range(rng.randrange(0, 4)):
            if pending:
                scheduler.add(pending.pop())
        out = scheduler.schedule()
        pickle.loads(pickle.dumps(out))  # plain data: it can go to a worker process
        view.apply(out)
        assert out.num_tokens <= scheduler.config.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        decodes_first = [s.is_decode for s in out.scheduled]
        assert decodes_first == sorted(decodes_first, reverse=True)
        for s in out.scheduled:
            assert len(view.tables[s.request_id]) * cache.block_size >= s.num_computed_tokens + s.num_new_tokens
            assert s.token_ids == scheduler.requests[s.request_id].token_slice(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens)
        scheduler.observe_step(out, _step_seconds(out))
        for update in scheduler.update_from_output(out, _sample_all(out)):
            if update.finished:
                scheduler.forget(update.request.request_id)
        if rng.random() < 0.05 and scheduler.running:
            victim = rng.choice(scheduler.running)
            scheduler.finish(victim.request_id, "abort")
            scheduler.forget(victim.request_id)
        _check_invariants(scheduler, cache, view)
        steps += 1
        assert steps < 100_000, "scheduler made no progress"
    return steps


def test_thousand_random_requests_leak_nothing():
    rng = random.Random(1234)
    cache = CacheManager(num_blocks=48, block_size=8, num_slots=12)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=96), cache)
    requests = [_request(i, rng.randrange(1, 120), rng.randrange(1, 40)) for i in range(1000)]
    _simulate(scheduler, cache, requests, rng)
    assert scheduler.num_preemptions > 0, "the cache was meant to be tight enough to preempt"
    assert all(r.is_finished for r in requests)
    assert all(r.finish_reason in ("length", "abort") for r in requests)
    assert all(len(r.output_token_ids) == r.params.max_tokens for r in requests if r.finish_reason == "length")
    assert cache.blocks.num_free == 48 and cache.slots.num_free == 12 and cache.num_holders == 0
    assert not scheduler.requests


def test_preemption_takes_the_latest_arrival_and_requeues_it_first():
    cache = CacheManager(num_blocks=4, block_size=4, num_slots=4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), cache)
    old, new = _request(0, 8, 100), _request(1, 8, 100)
    scheduler.add(old)
    scheduler.add(new)
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in out.new_requests] == ["r0", "r1"]
    scheduler.update_from_output(out, _sample_all(out))
    # Both now need a third block; only one can have it.
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled] == ["r0"] and not out.new_requests
    assert scheduler.waiting[0] is new and new.status is RequestStatus.WAITING
    assert new.num_computed_tokens == 0 and new.num_preemptions == 1
    scheduler.update_from_output(out, _sample_all(out))
    scheduler.finish("r0", "abort")
    out = scheduler.schedule()  # the preempted request restarts on the runner from scratch
    assert out.finished_request_ids == ["r0"]
    assert [r.request_id for r in out.new_requests] == ["r1"]
    (s,) = out.scheduled
    assert s.num_computed_tokens == 0 and s.token_ids == new.prompt_token_ids + new.output_token_ids
    assert s.new_block_ids == cache.blocks_of("r1")


def test_long_prompt_is_prefilled_in_budget_sized_chunks():
    cache = CacheManager(num_blocks=64, block_size=16, num_slots=2)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100), cache)
    long = _request(0, 250, 5)
    scheduler.add(long)
    chunks = []
    while not long.output_token_ids:
        out = scheduler.schedule()
        (s,) = out.scheduled
        chunks.append((s.num_new_tokens, s.samples))
        scheduler.update_from_output(out, _sample_all(out))
    assert chunks == [(100, False), (100, False), (50, True)]
    assert long.num_computed_tokens == 250 and long.output_token_ids == [1]


def test_deterministic_mode_feeds_one_token_per_request():
    cache = CacheManager(num_blocks=64, block_size=16, num_slots=4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100, deterministic=True), cache)
    for i in range(3):
        scheduler.add(_request(i, 10, 5))
    out = scheduler.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [1, 1, 1]


def _decoding(scheduler: Scheduler, request: Request) -> None:
    """Prefill `request` and take its first token."""
    scheduler.add(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, _sample_all(out, token=7))


def test_several_accepted_tokens_and_rollback_over_rejected_drafts():
    cache = CacheManager(num_blocks=16, block_size=4, num_slots=2)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), cache)
    request = _request(0, 6, 100)
    _decoding(scheduler, request)
    assert request.num_computed_tokens == 6 and request.output_token_ids == [7]
    request.draft_token_ids = [11, 12, 13]
    out = scheduler.schedule()
    (s,) = out.scheduled
    assert s.token_ids == [7, 11, 12, 13] and s.num_draft_tokens == 3 and s.is_decode and s.samples
    # The model agreed with the first draft only, then sampled 20 itself: 11 and 20 are kept,
    # drafts 12 and 13 were computed on a wrong prefix, so their positions get recomputed.
    (update,) = scheduler.update_from_output(out, ModelRunnerOutput(["r0"], [[11, 20]], [None]))
    assert update.new_token_ids == [11, 20]
    assert request.output_token_ids == [7, 11, 20]
    assert request.num_computed_tokens == 6 + 2  # the 7 and the accepted 11; 20 is not yet computed
    assert request.num_uncomputed == 1 and request.draft_token_ids == []
    out = scheduler.schedule()
    assert out.scheduled[0].token_ids == [20] and out.scheduled[0].num_computed_tokens == 8


def test_a_stop_among_accepted_tokens_drops_the_rest():
    cache = CacheManager(num_blocks=16, block_size=4, num_slots=2)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), cache)
    request = _request(0, 6, 100, stop_token_ids=[12])
    _decoding(scheduler, request)
    request.draft_token_ids = [11, 12, 13]
    out = scheduler.schedule()
    (update,) = scheduler.update_from_output(out, ModelRunnerOutput(["r0"], [[11, 12, 13, 14]], [None]))
    assert update.finished and update.new_token_ids == [11, 12]
    assert request.finish_reason == "stop" and request.stop_reason == 12
    assert request.output_token_ids == [7, 11, 12]
    assert cache.num_holders == 0 and scheduler.schedule().finished_request_ids == ["r0"]


def test_max_tokens_and_eos_stop_in_the_scheduler():
    cache = CacheManager(num_blocks=16, block_size=4, num_slots=4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), cache)
    short = _request(0, 3, 1)
    eos = Request("r1", [1, 2], SamplingParams(max_tokens=50), 10_000, eos_token_ids=frozenset({7}))
    ignoring = Request("r2", [1, 2], SamplingParams(max_tokens=50, ignore_eos=True), 10_000, eos_token_ids=frozenset({7}))
    for r in (short, eos, ignoring):
        scheduler.add(r)
    out = scheduler.schedule()
    updates = scheduler.update_from_output(out, _sample_all(out, token=7))
    assert [u.finished for u in updates] == [True, True, False]
    assert short.finish_reason == "length" and eos.finish_reason == "stop" and ignoring.status is RequestStatus.RUNNING


def test_a_request_aborted_during_the_step_takes_no_tokens():
    cache = CacheManager(num_blocks=16, block_size=4, num_slots=2)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), cache)
    request = _request(0, 6, 100)
    scheduler.add(request)
    out = scheduler.schedule()
    scheduler.finish("r0", "abort")
    assert scheduler.update_from_output(out, _sample_all(out)) == []
    assert request.output_token_ids == [] and request.finish_reason == "abort"


def test_the_pacer_learns_the_decode_cost_from_a_batch_sizes_first_steps_too():
    """A batch size's first decode steps run eagerly (their captured shape met first, then
    recording): the guard does not learn from them, but the pacer must, or the next prompts
    would ride in one unbounded chunk."""
    from oxserve.engine.interface import NEW_SHAPE, SETTLING

    cache = CacheManager(num_blocks=256, block_size=16, num_slots=8)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, max_stall=2.0), cache)
    scheduler.add(_request(0, 1000, 200))
    out = scheduler.schedule()
    for novelty in (STEADY, NEW_SHAPE, SETTLING):  # the prefill, then the first decode steps
        scheduler.observe_step(out, _step_seconds(out), novelty)
        scheduler.update_from_output(out, _sample_all(out))
        out = scheduler.schedule()
    assert scheduler.pacer.decode_step_s is not None and scheduler.pacer.prefill_token_s is not None
    scheduler.add(_request(1, 1000, 200))
    assert scheduler.schedule().num_tokens < 1001  # the prompt is paced beside the decode


@pytest.mark.parametrize("kinds,paced", [(["FINAL_ONLY"], False), (["FINAL_ONLY", "DELTA"], True), (["CUMULATIVE"], True)])
def test_the_pacer_bounds_prefill_only_beside_decodes_whose_output_is_wanted_as_it_comes(kinds, paced):
    """Decodes that want their output only when they finish (FINAL_ONLY: `LLM.generate`,
    offline batches) have no inter-token gaps anyone sees: beside them alone a prompt goes in
    whole (within the token budget); one decode of another output kind among them and the
    prompt is paced."""
    cache = CacheManager(num_blocks=512, block_size=16, num_slots=8)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, max_stall=2.0), cache)
    for i, kind in enumerate(kinds):
        scheduler.add(_request(i, 500, 200, output_kind=RequestOutputKind[kind]))
    out = scheduler.schedule()
    for _ in range(4):  # the prefill, then decode steps: both costs measured
        scheduler.observe_step(out, _step_seconds(out))
        scheduler.update_from_output(out, _sample_all(out))
        out = scheduler.schedule()
    assert scheduler.pacer.decode_step_s is not None and scheduler.pacer.prefill_token_s is not None
    scheduler.add(_request(9, 1000, 200))
    out = scheduler.schedule()
    assert out.num_decode_tokens == len(kinds)
    assert (out.num_tokens - out.num_decode_tokens < 1000) == paced


def test_stall_free_pacing_bounds_the_prefill_that_rides_with_decodes():
    """Measured costs, prompts arriving one at a time (no backlog the bound could not clear
    in CLEAR_STEPS steps): a mixed step stays within max_stall decode steps, prompts still
    advance, and a step with no decodes takes the whole token budget."""
    cache = CacheManager(num_blocks=256, block_size=16, num_slots=8)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048, max_stall=2.0), cache)
    first = _request(0, 1000, 200)
    scheduler.add(first)
    out = scheduler.schedule()
    assert out.num_tokens == 1000  # nothing to stall yet: no bound
    steps = []
    for i in range(1, 40):
        scheduler.observe_step(out, _step_seconds(out))
        scheduler.update_from_output(out, _sample_all(out))
        if i % 10 == 0:
            scheduler.add(_request(i, 400, 200))
        out = scheduler.schedule()
        steps.append(out)
    decode_only = [_step_seconds(o) for o in steps if o.num_decode_tokens == o.num_tokens]
    mixed = [o for o in steps if o.num_decode_tokens and o.num_tokens > o.num_decode_tokens]
    assert mixed and decode_only
    for o in mixed[3:]:  # the first mixed steps are the fit's first samples of carrying prefill
        assert _step_seconds(o) <= 2.0 * max(decode_only) * 1.05
        assert o.num_tokens - o.num_decode_tokens >= 16
    # Prompts advance oldest first, in paced chunks.
    assert scheduler.requests["r10"].output_token_ids and scheduler.requests["r20"].num_computed_tokens > 0


def test_stall_free_pacing_lets_a_backlog_through_faster_than_the_stall_bound():
    """Prompts queueing faster than the stall bound lets them through: holding them back only
    keeps requests from decoding, so each step may take 1 / CLEAR_STEPS of the backlog."""
    from oxserve.engine.pacing import CLEAR_STEPS

    cache = CacheManager(num_blocks=2048, block_size=16, num_slots=32)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=4096, max_stall=2.0), cache)
    scheduler.add(_request(0, 600, 400))
    out = scheduler.schedule()
    for _ in range(6):  # the costs are measured: decodes alone, then carrying the first prompts
        scheduler.observe_step(out, _step_seconds(out))
        scheduler.update_from_output(out, _sample_all(out))
        scheduler.add(_request(len(scheduler.requests), 300, 400))
        out = scheduler.schedule()
    backlog = 10 * 700
    for i in range(10):
        scheduler.add(_request(100 + i, 700, 400))
    steps = 0
    while any(r.num_uncomputed > 1 or r in scheduler.waiting for r in scheduler.requests.values()):
        scheduler.observe_step(out, _step_seconds(out))
        scheduler.update_from_output(out, _sample_all(out))
        out = scheduler.schedule()
        steps += 1
        assert steps < 200
    # at the stall bound alone (about 48 tokens a step) it would have taken ~150 steps; a
    # fixed share of what is left: CLEAR_STEPS * ln(backlog / (CLEAR_STEPS * 48)), then the bound
    assert CLEAR_STEPS < steps < backlog / 48 / 2


def test_the_prefill_backlog_counts_prompts_to_compute_not_imported_ones():
    """A decode instance's imported requests bring their prompts' caches: they are no backlog."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
                          CacheManager(num_blocks=64, block_size=4, num_slots=4))
    local, imported = _request(0, 30, 5), _request(1, 50, 5)
    imported.imported_tokens = 50
    scheduler.add(local)
    scheduler.add(imported)
    assert scheduler._prefill_backlog() == 30


def test_pacer_budget_from_measured_costs():
    from oxserve.engine.pacing import MIN_CHUNK, StepPacer

    def cost(prefill, decodes):  # base 50 ms, 5 ms a decode, 10 ms to carry prefill, 1 ms a token
        return 0.05 + 0.005 * decodes + (0.01 + 0.001 * prefill if prefill else 0.0)

    pacer = StepPacer(max_stall=3.0)
    assert pacer.prefill_budget(decodes=4) is None  # nothing measured yet
    pacer.observe(512, 0, cost(512, 0))
    rng = random.Random(0)
    for _ in range(40):  # every step carries prefill, at the budget the pacer sets
        prefill = pacer.prefill_budget(4) or 512
        pacer.observe(prefill, 4, cost(prefill, 4) * rng.uniform(0.97, 1.03))
    # (3 - 1) * (0.05 + 0.02) s of prefill at ~1 ms a token: ~140 tokens, in whole chunks
    budget = pacer.prefill_budget(decodes=4)
    assert 96 <= budget <= 160, budget
    assert cost(budget, 4) <= 3.0 * cost(0, 4) * 1.1
    assert pacer.prefill_budget(decodes=0) is None
    for _ in range(20):  # steps that stalled for other reasons cannot drive it below one chunk
        pacer.observe(600, 4, 100.0)
    assert pacer.prefill_budget(decodes=4) >= MIN_CHUNK
    off = StepPacer(max_stall=0)
    off.observe(512, 0, 0.5)
    off.observe(0, 4, 0.1)
    assert off.prefill_budget(decodes=4) is None


def _urgent(request: Request, priority: int, arrival: float) -> Request:
    request.priority, request.arrival_time = priority, arrival
    return request


def test_the_priority_policy_runs_by_priority_then_arrival():
    """One running place: whatever order they came in, the queue is served most urgent first,
    and equal priorities in arrival order."""
    rng = random.Random()
    cache = CacheManager(num_blocks=64, block_size=4, num_slots=2)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, scheduling_policy="priority"), cache)
    requests = [_urgent(_request(i, rng.randrange(1, 9), 2), rng.randrange(-2, 3), arrival=i) for i in range(12)]
    for r in rng.sample(requests, len(requests)):
        scheduler.add(r)
    admitted: list[str] = []
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        admitted += [r.request_id for r in out.new_requests]
        scheduler.update_from_output(out, _sample_all(out))
    expected = sorted(requests, key=lambda r: (r.priority, r.arrival_time))
    assert admitted == [r.request_id for r in expected]


def test_the_priority_policy_preempts_the_least_urgent_not_the_latest():
    cache = CacheManager(num_blocks=4, block_size=4, num_slots=4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, scheduling_policy="priority"), cache)
    old, urgent = _urgent(_request(0, 8, 100), 1, arrival=0), _urgent(_request(1, 8, 100), 0, arrival=1)
    scheduler.add(old)
    scheduler.add(urgent)
    out = scheduler.schedule()
    assert [r.request_id for r in out.new_requests] == ["r1", "r0"]
    scheduler.update_from_output(out, _sample_all(out))
    out = scheduler.schedule()  # both need a third block; the urgent one keeps running
    assert [s.request_id for s in out.scheduled] == ["r1"]
    assert old.num_preemptions == 1 and scheduler.waiting[0] is old and urgent.num_preemptions == 0


def test_random_prioritised_requests_leak_nothing():
    rng = random.Random()
    cache = CacheManager(num_blocks=48, block_size=8, num_slots=12)
    config = SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=96, scheduling_policy="priority")
    scheduler = Scheduler(config, cache)
    requests = [_urgent(_request(i, rng.randrange(1, 120), rng.randrange(1, 40)), rng.randrange(-3, 4), i) for i in range(400)]
    _simulate(scheduler, cache, requests, rng)
    assert all(r.is_finished for r in requests)
    assert cache.blocks.num_free == 48 and cache.slots.num_free == 12 and cache.num_holders == 0


def test_a_quarantined_step_reruns_each_request_alone_up_to_where_it_failed():
    """After a step raises: no checkpoint of its requests, and each is recomputed in steps of
    its own until it is past the failed step; then they batch again."""
    cache = CacheManager(num_blocks=64, block_size=4, num_slots=4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), cache)
    requests = [_request(i, 12, 3) for i in range(3)]
    for r in requests:
        scheduler.add(r)
    out = scheduler.schedule()
    scheduler.update_from_output(out, _sample_all(out))
    failed = scheduler.schedule()
    reach = {s.request_id: s.num_computed_tokens + s.num_new_tokens for s in failed.scheduled}
    assert len(reach) >= 2 and scheduler.quarantine(failed) == []
    assert cache.num_holders == 0 and [r.status for r in requests] == [RequestStatus.WAITING] * 3
    alone = []
    while any(r.isolate_until > r.num_computed_tokens for r in requests):
        out = scheduler.schedule()
        alone.append([s.request_id for s in out.scheduled])
        scheduler.update_from_output(out, _sample_all(out))
    assert all(len(ids) == 1 for ids in alone)
    assert [ids[0] for ids in alone] == sorted((ids[0] for ids in alone), key=lambda rid: int(rid[1:]))  # one suspect at a time
    assert all(r.num_computed_tokens >= reach[r.request_id] for r in requests if r.request_id in reach)
    out = scheduler.schedule()
    assert len(out.scheduled) > 1  # batched again
    only = out.scheduled[0]
    single = SchedulerOutput([], [only])
    (failed_alone,) = scheduler.quarantine(single)
    assert failed_alone.request_id == only.request_id and failed_alone.finish_reason == "error"
