"""Prefix caching's bookkeeping, without a model: hashing, sharing, eviction, checkpoints, and
a simulated runner that checks every step reads only what it would have computed itself."""

from __future__ import annotations

import random

import pytest

from oxserve.cache.blocks import ROOT, BlockPool, block_hash, prefix_hashes
from oxserve.cache.checkpoints import CheckpointIndex
from oxserve.cache.manager import CacheManager, PrefixCaching
from oxserve.config import SchedulerConfig
from oxserve.engine.interface import ModelRunnerOutput, SchedulerOutput
from oxserve.engine.request import Request
from oxserve.engine.scheduler import Scheduler
from oxserve.sampling_params import SamplingParams


def test_a_block_hash_names_its_whole_prefix():
    a = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], block_size=4)
    assert len(a) == 2, "the partial third block has no hash"
    b = prefix_hashes([0, 2, 3, 4, 5, 6, 7, 8], block_size=4)
    assert a[0] != b[0] and a[1] != b[1], "same second block after a different first one: a different prefix"
    assert a[1] == block_hash(block_hash(ROOT, [1, 2, 3, 4]), [5, 6, 7, 8])
    assert prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, start=1, parent=a[0]) == a[1:]


def test_block_pool_counts_holders_and_evicts_least_recently_used_content():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    ha = pool.register(a, ROOT, [1, 2])
    hb = pool.register(b, ha, [3, 4])
    assert pool.register(c, ROOT, [1, 2]) == ha and c not in pool.hash_of, "duplicate content stays unnamed"
    pool.acquire(a)  # a second request shares block a
    pool.release([a, b, c])
    assert pool.refs[a] == 1 and pool.num_free == 3  # b and c free, and the spare block
    assert pool.is_free_cached(b) and not pool.is_free_cached(c)
    pool.release([a])
    # Allocation takes blocks without content first, then the least recently freed content:
    # released last-first, b (the tail) before a (the prefix).
    first = pool.allocate(2)
    assert set(first) == {c, 3} and pool.block_of == {ha: a, hb: b}
    assert pool.allocate(1) == [b] and hb not in pool.block_of and pool.evictions == 1
    pool.acquire(a)  # a hit on a free cached block takes it back
    assert pool.num_free == 0 and pool.refs[a] == 1
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([a, a])


def test_checkpoint_index_finds_the_longest_matching_tail_and_protects_this_step():
    index = CheckpointIndex(3, policy="lru")
    short = index.add(ROOT, (5,), 1, 0, 1.0, 10)
    longer = index.add(ROOT, (5, 6, 7), 3, 0, 3.0, 10)
    index.add(ROOT, (9,), 1, 1, 1.0, 10)
    assert index.find(ROOT, [5, 6, 7, 8], max_tail=3) is longer
    assert index.find(ROOT, [5, 6, 7, 8], max_tail=2) is short
    assert index.find(ROOT, [5, 6, 0], max_tail=3) is short
    assert index.evict(list(index.live.values())) is None, "everything was added this step"
    index.step += 1
    index.use(longer)
    assert index.evict(list(index.live.values())) is short and len(index) == 2


def test_marconi_keeps_the_long_prefix_lru_keeps_the_recent_one():
    """Same size: a long prefix used first, then two short ones. lru drops the long one
    (the oldest); marconi (recency + prefill saved per byte) the older short one."""
    victims = {}
    for policy in ("lru", "marconi"):
        index = CheckpointIndex(3, policy=policy)
        for parent, position in ((b"long", 4000), (b"short", 40), (b"newest", 40)):
            index.add(parent, (), position, None, float(position) ** 2, 100)
            index.step += 1
        victims[policy] = index.evict(list(index.live.values())).parent
    assert victims == {"lru": b"long", "marconi": b"short"}


# ---- the scheduler and cache manager against a simulated runner ------------------------------
def _prefix(policy: str = "marconi", num_checkpoints: int = 6, interval: int = 0) -> PrefixCaching:
    return PrefixCaching(num_checkpoints=num_checkpoints, state_bytes=1000, block_bytes=100, prefill_cost=lambda n: n * n,
                         policy=policy, interval=interval)  # fmt: skip


class SimulatedRunner:
    """Applies the plain scheduler outputs to a fake cache whose rows hold token ids and
    whose state slots hold the tokens their state summarises. Before every step it checks
    that each request reads exactly the prefix it should: a block row or state left by
    another request, an evicted checkpoint or a stale copy shows up as a mismatch."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.rows: dict[tuple[int, int], int] = {}
        self.slots: dict[int, tuple[int, ...]] = {}
        self.saved: dict[int, tuple[int, ...]] = {}
        self.tables: dict[str, list[int]] = {}
        self.restores = self.copies = 0

    def step(self, out: SchedulerOutput, requests: dict[str, Request]) -> None:
        ops = out.cache_ops
        for slot, row in ops.saves:
            self.saved[row] = self.slots[slot]
        for row, slot in ops.restores:
            self.slots[slot] = self.saved[row]
            self.restores += 1
        for src, dst in ops.copies:
            for offset in range(self.bs):
                if (src, offset) in self.rows:
                    self.rows[(dst, offset)] = self.rows[(src, offset)]
            self.copies += 1
        for rid in out.finished_request_ids:
            self.tables.pop(rid, None)
        for new in out.new_requests:
            self.tables[new.request_id] = []
        for s in out.scheduled:
            table = self.tables[s.request_id]
            table += s.new_block_ids
            tokens = requests[s.request_id].token_slice(0, s.num_computed_tokens + s.num_new_tokens)
            start = s.num_computed_tokens
            for p in range(start):  # what attention reads
                assert self.rows.get((table[p // self.bs], p % self.bs)) == tokens[p], f"{s.request_id} reads a wrong row {p}"
            if start:  # what the KDA layers read
                assert self.slots.get(s.state_slot) == tuple(tokens[:start]), f"{s.request_id} starts from a wrong state"
            for p in range(start, start + s.num_new_tokens):
                self.rows[(table[p // self.bs], p % self.bs)] = tokens[p]
            self.slots[s.state_slot] = tuple(tokens)


def _drive(scheduler: Scheduler, requests: list[Request], rng: random.Random, runner: SimulatedRunner,
           after: dict[str, Request] | None = None) -> None:
    """Add requests a few at a time; a request in `after` is added once its key has finished."""
    pending = list(requests)
    steps = 0
    while pending or scheduler.has_unfinished():
        for _ in range(rng.randrange(0, 3)):
            ready = [r for r in pending if after is None or r.request_id not in after or after[r.request_id].is_finished]
            if ready:
                pending.remove(ready[0])
                scheduler.add(ready[0])
        out = scheduler.schedule()
        runner.step(out, scheduler.requests)
        sampled = [s.request_id for s in out.scheduled if s.samples]
        result = ModelRunnerOutput(sampled, [[rng.randrange(50, 60)] for _ in sampled], [None] * len(sampled))
        for update in scheduler.update_from_output(out, result):
            if update.finished:
                scheduler.forget(update.request.request_id)
        steps += 1
        assert steps < 50_000, "no progress"


def _conversation_requests(rng: random.Random, conversations: int, turns: int, system: list[int]):
    """Turn t's prompt is turn t-1's prompt and output plus a new message (the test fills the
    output in when turn t-1 finishes)."""
    requests, after = [], {}
    for c in range(conversations):
        previous = None
        for t in range(turns):
            message = [rng.randrange(100, 200) for _ in range(rng.randrange(1, 12))]
            r = Request(f"c{c}t{t}", system + message, SamplingParams(max_tokens=rng.randrange(1, 8)), 10_000)
            if previous is not None:
                r.prompt_token_ids = _Later(previous, message)
                after[r.request_id] = previous
            requests.append(r)
            previous = r
    return requests, after


class _Later(list):
    """A prompt known once an earlier turn has finished: its prompt + output + message."""

    def __init__(self, previous: Request, message: list[int]):
        super().__init__()
        self.previous, self.message = previous, message

    def resolve(self) -> None:
        if not self:
            self.extend(self.previous.prompt_token_ids + self.previous.output_token_ids + self.message)


@pytest.mark.parametrize("policy", ["marconi", "lru"])
def test_conversations_hit_and_never_read_what_they_did_not_compute(policy):
    """Interleaved multi-turn conversations behind a shared system prompt, in a block pool
    and a checkpoint pool both too small for them (forced eviction, preemption). Pools this
    small sometimes evict every prefix before its next turn (no hit in 2-6% of draws), so
    fresh conversations are drawn until some hit; every draw must read only what it computed."""
    hits = restores = 0
    for _ in range(MAX_DRAWS):
        cache, runner = _run_conversations(policy, random.Random())
        hits, restores = hits + cache.stats.hits, restores + runner.restores
        if hits and restores:
            break
    assert hits > 0 and restores > 0


MAX_DRAWS = 6


def _run_conversations(policy: str, rng: random.Random):
    bs = 4
    cache = CacheManager(num_blocks=40, block_size=bs, num_slots=6, prefix=_prefix(policy, num_checkpoints=5, interval=2))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=rng.choice([7, 16, 64])), cache)
    system = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 23))]
    requests, after = _conversation_requests(rng, conversations=8, turns=4, system=system)
    original_add = scheduler.add

    def add(request: Request) -> None:
        if isinstance(request.prompt_token_ids, _Later):
            request.prompt_token_ids.resolve()
            request.prompt_token_ids = list(request.prompt_token_ids)
        original_add(request)

    scheduler.add = add
    runner = SimulatedRunner(bs)
    _drive(scheduler, requests, rng, runner, after)
    assert all(r.is_finished for r in requests)
    assert cache.checkpoints.evictions > 0 and cache.blocks.evictions > 0, "the pools were meant to be too small"
    # Nothing leaked: every block is free or pinned by a live checkpoint.
    pinned = [c.block for c in cache.checkpoints.live.values() if c.block is not None]
    assert cache.blocks.num_free + len(set(pinned)) == cache.blocks.size
    assert sum(cache.blocks.refs) == len(pinned)
    return cache, runner


def test_a_repeated_prompt_resumes_at_every_length():
    """A prompt of n tokens, then the same n tokens plus one more: the second resumes at n
    (the first one's prompt-end checkpoint; lru admits those) for every n from 1 up."""
    bs = 4
    for n in range(1, 14):
        cache = CacheManager(num_blocks=64, block_size=bs, num_slots=2, prefix=_prefix("lru"))
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), cache)
        runner = SimulatedRunner(bs)
        first = Request("a", list(range(1, n + 1)), SamplingParams(max_tokens=3), 10_000)
        second = Request("b", list(range(1, n + 2)), SamplingParams(max_tokens=3), 10_000)
        _drive(scheduler, [first], random.Random(0), runner)
        _drive(scheduler, [second], random.Random(0), runner)
        assert cache.stats.hits == n, n
        assert runner.copies == (1 if n % bs else 0), "a partial block is copied, a full one shared"


def test_a_shared_prefix_is_checkpointed_where_prompts_part():
    """Two prompts sharing 37 tokens and no template marks: the second saves its state at
    token 37 (a branch point), and a third with the same 37 tokens resumes there."""
    bs = 8
    cache = CacheManager(num_blocks=64, block_size=bs, num_slots=3, prefix=_prefix("marconi"))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=256), cache)
    runner = SimulatedRunner(bs)
    shared = list(range(1, 38))
    for i, rid in enumerate("abc"):
        _drive(scheduler, [Request(rid, shared + [200 + i] * 20, SamplingParams(max_tokens=2), 10_000)], random.Random(0), runner)
    assert cache.stats.hits == 37 and cache.stats.hit_requests == 1


def test_reset_forgets_every_prefix_only_when_nothing_runs():
    bs = 4
    cache = CacheManager(num_blocks=32, block_size=bs, num_slots=2, prefix=_prefix("lru"))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), cache)
    runner = SimulatedRunner(bs)
    _drive(scheduler, [Request("a", list(range(1, 30)), SamplingParams(max_tokens=2), 10_000)], random.Random(0), runner)
    assert len(cache.checkpoints) > 0 and cache.blocks.num_cached > 0
    scheduler.add(Request("b", list(range(1, 31)), SamplingParams(max_tokens=2), 10_000))
    scheduler.update_from_output(out := scheduler.schedule(), ModelRunnerOutput([], [], []))
    runner.step(out, scheduler.requests)
    assert cache.stats.hits == 29 and not cache.reset_prefix_cache(), "b holds cache: no reset"
    scheduler.finish("b", "abort")
    assert cache.reset_prefix_cache()
    assert len(cache.checkpoints) == 0 and cache.blocks.num_cached == 0 and cache.blocks.num_free == cache.blocks.size
    _drive(scheduler, [Request("c", list(range(1, 31)), SamplingParams(max_tokens=2), 10_000)], random.Random(0), runner)
    assert cache.stats.hits == 29, "c computed everything again"


def test_room_for_a_resume_does_not_count_the_blocks_it_shares_as_reclaimable():
    """A checkpoint at 6 pins block 1; once filled, block 1 is also a shared full block of a
    hit at 8. Sharing it takes it off the reclaimable list, so it is no room for the resume."""
    bs = 4
    cache = CacheManager(num_blocks=3, block_size=bs, num_slots=2, prefix=_prefix("lru"))
    tokens = list(range(1, 17))

    def tokens_of(start: int, end: int) -> list[int]:
        return tokens[start:end]

    cache.grow("a", 8)
    cache.checkpoint("a", 6, tokens_of, "prompt_end")
    cache.checkpoint("a", 8, tokens_of, "finish")
    cache.register("a", 8, tokens_of)
    cache.release("a")
    cache.next_step()
    hit = cache.lookup(tokens, 15)
    assert hit.position == 8 and len(hit.blocks) == 2 and hit.checkpoint.block is None
    assert not cache.can_resume(hit, 16), "one block free (block 0 is reused): no room for two more"
    assert cache.can_resume(hit, 12)
    cache.resume("b", hit, 12)
