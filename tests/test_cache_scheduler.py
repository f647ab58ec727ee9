"""Block/slot bookkeeping and scheduling, on CPU, without a model."""

from __future__ import annotations

import random

import pytest

from oxserve.cache.manager import CacheManager, IdPool
from oxserve.config import SchedulerConfig
from oxserve.engine.request import Request, RequestStatus
from oxserve.engine.scheduler import Scheduler
from oxserve.sampling_params import SamplingParams


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


def _request(i: int, prompt_len: int, max_tokens: int) -> Request:
    return Request(
        request_id=f"r{i}",
        prompt_token_ids=list(range(prompt_len)),
        params=SamplingParams(max_tokens=max_tokens),
        max_total_tokens=10_000,
    )


def _check_invariants(scheduler: Scheduler, cache: CacheManager) -> None:
    held = [b for r in scheduler.running for b in cache.blocks_of(r.request_id)]
    assert len(held) == len(set(held)), "a block is held twice"
    assert len(held) + cache.blocks.num_free == cache.blocks.size, "blocks leaked"
    assert cache.num_holders == len(scheduler.running)
    assert cache.slots.num_free + len(scheduler.running) == cache.slots.size
    for r in scheduler.waiting:
        assert not cache.blocks_of(r.request_id) and r.num_computed_tokens == 0


def _simulate(scheduler: Scheduler, cache: CacheManager, requests: list[Request], rng: random.Random) -> int:
    """Drive the scheduler the way the engine does; abort some requests on the way."""
    pending = list(requests)
    steps = 0
    while pending or scheduler.has_unfinished():
        for _ in range(rng.randrange(0, 4)):
            if pending:
                scheduler.add(pending.pop())
        out = scheduler.schedule()
        assert out.num_tokens <= scheduler.config.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        for s in out.scheduled:
            assert len(s.block_ids) * cache.block_size >= s.request.num_computed_tokens + s.num_new_tokens
        decodes_first = [s.is_decode for s in out.scheduled]
        assert decodes_first == sorted(decodes_first, reverse=True)
        for s in out.scheduled:
            r = s.request
            sampling = s.completes_sequence
            r.num_computed_tokens += s.num_new_tokens
            if sampling:
                r.output_token_ids.append(1)
                if len(r.output_token_ids) >= r.params.max_tokens:
                    r.finish("length")
                    scheduler.finish(r)
        if rng.random() < 0.05 and scheduler.running:
            victim = rng.choice(scheduler.running)
            victim.finish("abort")
            scheduler.finish(victim)
        _check_invariants(scheduler, cache)
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
    assert cache.blocks.num_free == 48 and cache.slots.num_free == 12 and cache.num_holders == 0


def test_preemption_takes_the_latest_arrival_and_requeues_it_first():
    cache = CacheManager(num_blocks=4, block_size=4, num_slots=4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), cache)
    old, new = _request(0, 8, 100), _request(1, 8, 100)
    scheduler.add(old)
    scheduler.add(new)
    out = scheduler.schedule()
    assert [s.request for s in out.scheduled] == [old, new]
    for s in out.scheduled:
        s.request.num_computed_tokens += s.num_new_tokens
        s.request.output_token_ids.append(1)
    # Both now need a third block; only one can have it.
    out = scheduler.schedule()
    assert out.preempted == [new]
    assert [s.request for s in out.scheduled] == [old]
    assert scheduler.waiting[0] is new and new.status is RequestStatus.WAITING
    assert new.num_computed_tokens == 0 and new.num_preemptions == 1


def test_long_prompt_is_prefilled_in_budget_sized_chunks():
    cache = CacheManager(num_blocks=64, block_size=16, num_slots=2)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100), cache)
    long = _request(0, 250, 5)
    scheduler.add(long)
    chunks = []
    while not long.output_token_ids:
        out = scheduler.schedule()
        (s,) = out.scheduled
        chunks.append(s.num_new_tokens)
        completes = s.completes_sequence
        long.num_computed_tokens += s.num_new_tokens
        if completes:
            long.output_token_ids.append(1)
    assert chunks == [100, 100, 50]


def test_deterministic_mode_feeds_one_token_per_request():
    cache = CacheManager(num_blocks=64, block_size=16, num_slots=4)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100, deterministic=True), cache)
    for i in range(3):
        scheduler.add(_request(i, 10, 5))
    out = scheduler.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [1, 1, 1]
