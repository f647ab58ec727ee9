"""The native KDA decode kernels on a bf16 state table: each call computes exactly what it
computes on an fp32 table holding the same values, and rounds the states it changes to bf16
where the torch version does (a write-back step's or run's new state, a fold's checkpoint;
a replay step leaves its checkpoint as it is). Random shapes, slots out of order."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from oxserve.cache.layers import ReplayRing
from oxserve.cache.replay import ring_counts
from oxserve.kernels import kda_decode

SLOTS = 7


def _rounded_table(heads: int, dk: int, dv: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 states that bf16 holds exactly."""
    return (torch.randn(SLOTS, heads, dk, dv, generator=gen) * 0.3).bfloat16().float()


def _tokens(n: int, heads: int, dk: int, dv: int, gen: torch.Generator):
    q = F.normalize(torch.randn(n, heads, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(n, heads, dk, generator=gen), dim=-1)
    v = torch.randn(n, heads, dv, generator=gen)
    g = -5.0 * torch.rand(n, heads, dk, generator=gen) ** 3
    beta = torch.rand(n, heads, generator=gen)
    return q, k, v, g, beta


def _case(seed: int):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    heads, dk, dv = rng.randint(1, 4), rng.choice([8, 24, 64, 7]), rng.choice([16, 64, 40, 96])
    slots = torch.tensor(rng.sample(range(SLOTS), rng.randint(1, SLOTS)))
    return rng, gen, heads, dk, dv, slots


@pytest.fixture(params=[1, 3], ids=["1-thread", "3-threads"])
def seed(request) -> int:
    """A fresh seed (printed by each assertion), under 1 thread and under 3 (more threads than
    some calls have tasks: each thread's own fp32 copy)."""
    assert kda_decode._kernel() is not None, "the native KDA decode kernel did not build"
    threads = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield random.SystemRandom().randrange(2**31)
    torch.set_num_threads(threads)


def test_writeback_step_is_the_fp32_step_rounded(seed):
    _, gen, heads, dk, dv, slots = _case(seed)
    table = _rounded_table(heads, dk, dv, gen)
    half = table.bfloat16()
    for _ in range(3):
        inputs = _tokens(len(slots), heads, dk, dv, gen)
        want = kda_decode.writeback_step(table, slots, *inputs)
        got = kda_decode.writeback_step(half, slots, *inputs)
        assert torch.equal(got, want), f"seed {seed}"
        assert torch.equal(half, table.bfloat16()), f"seed {seed}"
        table = half.float()  # the fp32 side goes on from the rounded states, as the bf16 side does


def test_writeback_run_is_the_fp32_run_rounded(seed):
    rng, gen, heads, dk, dv, slots = _case(seed)
    table = _rounded_table(heads, dk, dv, gen)
    half = table.bfloat16()
    lens = [rng.randint(0, 9) for _ in slots]
    fresh = torch.tensor([rng.random() < 0.5 for _ in slots])
    inputs = _tokens(sum(lens), heads, dk, dv, gen)
    want = kda_decode.writeback_run(table, slots, fresh, lens, *inputs)
    got = kda_decode.writeback_run(half, slots, fresh, lens, *inputs)
    assert torch.equal(got, want), f"seed {seed}"
    assert torch.equal(half, table.bfloat16()), f"seed {seed}"


def _ring(heads: int, dk: int, dv: int, length: int, gen: torch.Generator) -> ReplayRing:
    """A ring full of plausible entries (factored keys: k * exp(-G), G cumulative)."""
    decays = (-5.0 * torch.rand(SLOTS, heads, length, dk, generator=gen) ** 3).cumsum(2)
    keys = F.normalize(torch.randn(SLOTS, heads, length, dk, generator=gen), dim=-1) * (-decays).exp()
    deltas = torch.randn(SLOTS, heads, length, dv, generator=gen) * 0.3
    return ReplayRing(keys, decays, deltas, exact=False)


def _clone(ring: ReplayRing) -> ReplayRing:
    return ReplayRing(ring.keys.clone(), ring.decays.clone(), ring.deltas.clone(), exact=ring.exact)


def test_replay_fold_rounds_the_fp32_fold(seed):
    rng, gen, heads, dk, dv, slots = _case(seed)
    table, ring = _rounded_table(heads, dk, dv, gen), _ring(heads, dk, dv, 6, gen)
    half = table.bfloat16()
    counts = [rng.randint(0, 6) for _ in slots]
    kda_decode.replay_fold(table, ring, slots, counts, torch.tensor(counts))
    kda_decode.replay_fold(half, ring, slots, counts, torch.tensor(counts))
    assert torch.equal(half, table.bfloat16()), f"seed {seed}"


def test_replay_step_reads_the_checkpoint_as_the_table_holds_it(seed):
    """A step whose ring is full folds it and rounds the checkpoint before reading it; the
    others read the checkpoint as it is. Against fp32: the fold, the rounding, then the step."""
    rng, gen, heads, dk, dv, slots = _case(seed)
    length = 5
    table, ring = _rounded_table(heads, dk, dv, gen), _ring(heads, dk, dv, length, gen)
    half, half_ring = table.bfloat16(), _clone(ring)
    counts = [length] + [rng.choice([length, rng.randint(0, length - 1)]) for _ in slots[1:]]  # a fold at least
    inputs = _tokens(len(slots), heads, dk, dv, gen)
    got = kda_decode.replay_step(half, half_ring, slots, counts, torch.tensor(counts), *inputs)
    full = [i for i, c in enumerate(counts) if c == length]
    kda_decode.replay_fold(table, ring, slots[full], [length] * len(full), torch.tensor([length] * len(full)))
    table.copy_(table.bfloat16())
    after = [0 if c == length else c for c in counts]
    want = kda_decode.replay_step(table, ring, slots, after, torch.tensor(after), *inputs)
    assert torch.equal(got, want), f"seed {seed}"
    assert torch.equal(half.float(), table), f"seed {seed}"
    for name in ("keys", "decays", "deltas"):
        assert torch.equal(getattr(half_ring, name), getattr(ring, name)), f"seed {seed}: ring {name}"


def test_replay_verify_reads_the_checkpoint_as_the_table_holds_it(seed):
    """Verify runs (a token and its drafts, 1-4 tokens a request): a ring that cannot take
    the run is folded and the checkpoint rounded first. Against fp32: the fold, the
    rounding, then the runs."""
    rng, gen, heads, dk, dv, slots = _case(seed)
    length = 6
    table, ring = _rounded_table(heads, dk, dv, gen), _ring(heads, dk, dv, length, gen)
    half, half_ring = table.bfloat16(), _clone(ring)
    lens = [rng.randint(1, 4) for _ in slots]
    counts = [length] + [rng.randint(0, length) for _ in slots[1:]]  # the first folds at least
    inputs = _tokens(sum(lens), heads, dk, dv, gen)
    got = kda_decode.replay_verify(half, half_ring, slots, ring_counts([], [], counts, lens, "cpu"), lens, *inputs)
    full = [i for i, (c, n) in enumerate(zip(counts, lens)) if c + n > length]
    folds = [counts[i] for i in full]
    kda_decode.replay_fold(table, ring, slots[full], folds, torch.tensor(folds))
    table.copy_(table.bfloat16())
    after = [0 if i in full else c for i, c in enumerate(counts)]
    want = kda_decode.replay_verify(table, ring, slots, ring_counts([], [], after, lens, "cpu"), lens, *inputs)
    assert torch.equal(got, want), f"seed {seed}"
    assert torch.equal(half.float(), table), f"seed {seed}"
    for name in ("keys", "decays", "deltas"):
        assert torch.equal(getattr(half_ring, name), getattr(ring, name)), f"seed {seed}: ring {name}"
