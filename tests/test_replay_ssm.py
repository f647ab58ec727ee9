"""ReplaySSM KDA decode against write-back: long random runs through the KDA layer's own
state handling (decodes, prefill chunks that follow decodes, requests restarting in a used
slot), on the native kernel and the torch version, in both key forms; then the engine."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from oxserve import LLM, SamplingParams
from oxserve.cache.precision import LayerCachePrecision
from oxserve.cache.replay import ReplayBook, ring_counts
from oxserve.cache.spec import CacheLayout
from oxserve.default_model import make_text_config
from oxserve.kernels import kda_decode, reference
from oxserve.model.batch import BatchRequest, make_forward_batch
from oxserve.model.config import TextModelConfig
from oxserve.model.kda import KDAttention

SLOTS, LIVE = 6, 4


def _layer(lower_bound: float | None, heads=2, head_dim=16) -> tuple[TextModelConfig, KDAttention]:
    cfg = TextModelConfig.from_hf_dict(make_text_config(
        hidden_size=32, num_hidden_layers=1, layer_types=["linear_attention"], mlp_layer_types=["dense"],
        indexer_types=["full"], linear_num_heads=heads, linear_head_dim=head_dim, linear_lower_bound=lower_bound))
    return cfg, KDAttention(cfg, "L0.kda")


class _Run:
    """One KDA layer's caches driven step by step, as the runner drives them."""

    def __init__(self, cfg, layer, ring: int, state_dtype: str = "float32"):
        self.cfg, self.layer = cfg, layer
        spec = layer.cache_spec(torch.float32, LayerCachePrecision(kda_state=state_dtype), replay=ring)
        self.cache = spec.allocate(CacheLayout(num_blocks=1, block_size=64, num_slots=SLOTS), "cpu")
        self.book = ReplayBook(SLOTS, ring) if ring else None

    def step(self, requests: list[BatchRequest], q, k, v, g, beta) -> torch.Tensor:
        batch = make_forward_batch(requests, self.cfg, 1 << 30, 1, "cpu", self.book)  # one block: no MLA layers
        return self.layer._delta_rule(q, k, v, g, beta, batch, self.cache)


def _tokens(n: int, heads: int, d: int, lower_bound: float | None, gen: torch.Generator):
    q = F.normalize(torch.randn(n, heads, d, generator=gen), dim=-1) * d**-0.5
    k = F.normalize(torch.randn(n, heads, d, generator=gen), dim=-1)
    v = torch.randn(n, heads, d, generator=gen)
    scale = abs(lower_bound) if lower_bound is not None else 30.0  # unbounded: decays up to 30 per token
    g = -scale * torch.rand(n, heads, d, generator=gen) ** 3  # mostly mild, some strong
    beta = torch.rand(n, heads, generator=gen)
    return q, k, v, g, beta


def _random_steps(steps: int, rng: random.Random):
    """Per step, the requests that run: mostly decodes; prefill chunks of requests that have
    decoded (chunked prefill after decode); requests replaced by new ones in their slot."""
    live = {slot: 0 for slot in rng.sample(range(SLOTS), LIVE)}  # slot -> tokens so far
    for _ in range(steps):
        decodes, prefills = [], []
        for slot in list(live):
            roll = rng.random()
            if roll < 0.03:  # finished: a new request takes the slot (as after preemption)
                live[slot] = 0
            n = 1 if live[slot] and roll > 0.1 else rng.randrange(2, 24)
            (decodes if n == 1 else prefills).append(BatchRequest(live[slot], n, [0], slot, True))
            live[slot] += n
        yield decodes + prefills


@pytest.mark.parametrize("path,lower_bound,ring", [
    ("native", -5.0, 16), ("native", -5.0, 3), ("native", None, 16), ("native", -0.5, 1),
    ("torch", -5.0, 16), ("torch", None, 5),
], ids=["native-factored-16", "native-factored-3", "native-exact-16", "native-factored-1", "torch-factored-16", "torch-exact-5"])
def test_replay_equals_write_back_over_thousands_of_steps(path, lower_bound, ring, monkeypatch):
    if path == "torch":
        monkeypatch.setattr(kda_decode, "_native", lambda *tensors: None)
    else:
        assert kda_decode._kernel() is not None, "the native KDA decode kernel did not build"
    assert kda_decode.replay_exact(lower_bound, ring) == (lower_bound is None)
    cfg, layer = _layer(lower_bound)
    write_back, replay = _Run(cfg, layer, 0), _Run(cfg, layer, ring)
    seed = random.SystemRandom().randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    folds = settles = 0
    for requests in _random_steps(2000 if path == "native" else 1000, rng):
        inputs = _tokens(sum(r.num_new_tokens for r in requests), cfg.linear_num_heads, cfg.linear_head_dim, lower_bound, gen)
        before = list(replay.book.counts)
        expected = write_back.step(requests, *inputs)
        got = replay.step(requests, *inputs)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")
        folds += sum(before[r.state_slot] == ring for r in requests if r.num_new_tokens == 1)
        settles += sum(before[r.state_slot] > 0 for r in requests if r.num_new_tokens > 1 and r.num_computed_tokens)
    assert folds > 50 and settles > 50, (folds, settles)
    # Settled, every checkpoint is the full state the write-back path holds.
    slots = torch.arange(SLOTS)
    counts = replay.book.counts
    kda_decode.replay_fold(replay.cache.recurrent, replay.cache.ring, slots, counts, torch.tensor(counts))
    torch.testing.assert_close(replay.cache.recurrent, write_back.cache.recurrent, rtol=1e-4, atol=1e-5)


def test_native_kernels_match_the_token_by_token_reference():
    """Both native steps against the plain float64 recurrence, batch slots out of order."""
    _, layer = _layer(-5.0, heads=3, head_dim=24)
    h, d = 3, 24
    gen = torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))
    states = torch.randn(SLOTS, h, d, d, generator=gen) * 0.1
    expected = states.double().clone()
    write_back, replay = states.clone(), states.clone()
    spec = layer.cache_spec(torch.float32, replay=4)
    ring = spec.ring.allocate(CacheLayout(1, 64, SLOTS), "cpu")
    book = ReplayBook(SLOTS, 4)
    slots = torch.tensor([4, 0, 5, 2])
    for _ in range(23):
        q, k, v, g, beta = _tokens(4, h, d, -5.0, gen)
        out, new = reference.delta_rule_step(q.double(), k.double(), v.double(), g.double(), beta.double(), expected[slots])
        expected[slots] = new
        counts = book.advance(slots.tolist(), [True] * 4, 4, "cpu")
        torch.testing.assert_close(kda_decode.writeback_step(write_back, slots, q, k, v, g, beta), out.float(), rtol=1e-5, atol=1e-6)
        got = kda_decode.replay_step(replay, ring, slots, counts.decodes, counts.decode_counts, q, k, v, g, beta)
        torch.testing.assert_close(got, out.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(write_back, expected.float(), rtol=1e-5, atol=1e-6)


def test_native_verify_runs_match_the_token_by_token_reference():
    """Verifies: runs of 1-5 tokens per request in one native call, against the float64
    recurrence, rings folded first when a run does not fit (ring 6)."""
    _, layer = _layer(-5.0, heads=3, head_dim=24)
    h, d, ring_len = 3, 24, 6
    rng = random.Random(random.SystemRandom().randrange(2**31))
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    states = torch.randn(SLOTS, h, d, d, generator=gen) * 0.1
    expected = states.double().clone()
    ring = layer.cache_spec(torch.float32, replay=ring_len).ring.allocate(CacheLayout(1, 64, SLOTS), "cpu")
    counts = [0] * SLOTS
    folds = 0
    for _ in range(30):
        slots = rng.sample(range(SLOTS), rng.randrange(1, SLOTS + 1))
        lens = [rng.randrange(1, 6) for _ in slots]
        q, k, v, g, beta = _tokens(sum(lens), h, d, -5.0, gen)
        want, t = [], 0
        for slot, n in zip(slots, lens):
            for _ in range(n):
                out, expected[slot] = reference.delta_rule_step(q[t].double()[None], k[t].double()[None], v[t].double()[None],
                                                                g[t].double()[None], beta[t].double()[None],
                                                                expected[slot][None])  # fmt: skip
                want.append(out[0])
                t += 1
        before = ring_counts([], [], [counts[s] for s in slots], lens, "cpu")
        got = kda_decode.replay_verify(states, ring, torch.tensor(slots), before, lens, q, k, v, g, beta)
        torch.testing.assert_close(got, torch.stack(want).float(), rtol=1e-5, atol=1e-6)
        for slot, n in zip(slots, lens):
            folds += counts[slot] + n > ring_len
            counts[slot] = (counts[slot] if counts[slot] + n <= ring_len else 0) + n
    assert folds > 5
    kda_decode.replay_fold(states, ring, torch.arange(SLOTS), counts, torch.tensor(counts))
    torch.testing.assert_close(states, expected.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_bf16_checkpoints_round_only_at_folds(path, monkeypatch):
    """A bf16 state table: replay rounds the state once per fold, write-back once per step, so
    replay stays at least as close to the fp32 run."""
    if path == "torch":
        monkeypatch.setattr(kda_decode, "_native", lambda *tensors: None)
    cfg, layer = _layer(-5.0)
    exact_run = _Run(cfg, layer, 0)
    runs = {"write-back": _Run(cfg, layer, 0, "bfloat16"), "replay": _Run(cfg, layer, 16, "bfloat16")}
    rng, gen = random.Random(5), torch.Generator().manual_seed(5)
    errors = {name: 0.0 for name in runs}
    for requests in _random_steps(300, rng):
        inputs = _tokens(sum(r.num_new_tokens for r in requests), 2, 16, -5.0, gen)
        expected = exact_run.step(requests, *inputs)
        for name, run in runs.items():
            errors[name] = max(errors[name], float((run.step(requests, *inputs) - expected).abs().max()))
    assert errors["replay"] <= errors["write-back"] * 1.05 and errors["replay"] < 0.05, errors


def test_ring_is_counted_by_the_memory_planner():
    _, layer = _layer(-5.0, heads=4, head_dim=32)
    plain, replay = layer.cache_spec(torch.float32), layer.cache_spec(torch.float32, replay=16)
    ring_bytes = 16 * 4 * (32 + 32 + 32) * 4  # keys, log-decays, deltas in fp32
    assert sum(t.bytes for t in replay.states) == sum(t.bytes for t in plain.states) + ring_bytes


@pytest.mark.slow
def test_engine_replay_generates_what_write_back_generates(tiny_model_dir):
    """Long greedy outputs (folds every 7 steps), a token budget that splits prompts around decodes,
    and a cache too small for every request (preemption): the same tokens either way, up to
    a pick that fp32 rounding can flip (top two within 1e-4 nats; none expected, most runs)."""
    rng = random.Random()
    prompts = [[rng.randrange(20, 8000) for _ in range(rng.randrange(1, 120))] for _ in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, logprobs=2)
    options = dict(dtype="float32", max_num_batched_tokens=40, block_size=16, num_blocks=80, max_model_len=336)
    outputs = {}
    for mode in ("write-back", "replay"):
        llm = LLM(model=str(tiny_model_dir), kda_decode=mode, kda_replay_len=7, **options)
        outputs[mode] = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert llm.engine.stats().num_preemptions > 0
    compared = 0
    for plain, replayed in zip(outputs["write-back"], outputs["replay"]):
        same = next((i for i, (a, b) in enumerate(zip(plain.token_ids, replayed.token_ids)) if a != b), None)
        if same is not None:
            top = sorted(plain.logprobs[same].values(), reverse=True)
            assert top[0] - top[1] < 1e-4, f"replay diverged at token {same} with a margin of {top[0] - top[1]:.3g}"
        compared += len(plain.token_ids) if same is None else same
    assert compared > 1500
