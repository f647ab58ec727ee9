"""Speculative decoding with the checkpoint's MTP layer (`{"method": "mtp"}`)."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import TINY_TEXT_CONFIG

from oxserve import LLM, SamplingParams
from oxserve.cache.spec import CacheLayout
from oxserve.default_model import build_checkpoint
from oxserve.model.batch import BatchRequest, make_forward_batch
from oxserve.model.loader import load_model

MTP_SPEC = '{"method": "mtp", "num_speculative_tokens": 3}'


@pytest.fixture(scope="module")
def tiny_mtp_dir(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("tiny-mtp"), TINY_TEXT_CONFIG, seed=11, dtype=torch.float32, mtp=True)


def _first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)


def test_mtp_greedy_equals_plain_greedy(tiny_mtp_dir):
    """Chunked prompts, preemption, drafts near block ends: the same tokens as plain greedy."""
    rng = random.Random()
    prompts = [[rng.randrange(20, 8000) for _ in range(rng.randrange(1, 90))] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, logprobs=2)
    options = dict(dtype="float32", max_num_batched_tokens=48, block_size=16, num_blocks=40, max_model_len=256)
    plain = [o.outputs[0] for o in LLM(model=str(tiny_mtp_dir), **options).generate(prompts, params)]
    llm = LLM(model=str(tiny_mtp_dir), speculative_config=MTP_SPEC, kda_replay_len=4, **options)
    spec = [o.outputs[0] for o in llm.generate(prompts, params)]
    stats = llm.engine.stats()
    assert stats.spec_draft_tokens > 0
    for a, b in zip(plain, spec):
        first = _first_difference(a, b)
        if first is not None:  # only a pick that fp32 rounding can flip may differ
            top = sorted(a.logprobs[first].values(), reverse=True)
            assert top[0] - top[1] < 1e-4, f"diverged at token {first} (margin {top[0] - top[1]:.3g})"
        assert len(b.token_ids) == len(a.token_ids) == 60


def test_a_checkpoint_without_mtp_layer_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="no MTP layer"):
        LLM(model=str(tiny_model_dir), speculative_config=MTP_SPEC)


def _teacher_forced_first_drafts(path, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass of the target then the MTP layer over the whole sequence: MTP logits [T-1, V]
    at each position q (given the target's hidden state at q and token q + 1)."""
    model = load_model(path, dtype=torch.float32, with_mtp=True).model
    layout = CacheLayout(num_blocks=-(-len(tokens) // 16) + 1, block_size=16, num_slots=1)
    specs = model.cache_specs(torch.float32, kda_replay=0)
    caches = [spec.allocate(layout, "cpu") for spec in specs]
    mtp_cache = model.mtp.cache_spec(torch.float32).allocate(layout, "cpu")
    table = list(range(layout.num_blocks))
    n = len(tokens)
    with torch.inference_mode():
        batch = make_forward_batch([BatchRequest(0, n, table, 0, True)], model.config, 16, layout.num_blocks, "cpu")
        hidden = model(torch.tensor(tokens), batch, caches, all_rows=True)
        batch = make_forward_batch([BatchRequest(0, n - 1, table, 0, True)], model.config, 16, layout.num_blocks, "cpu")
        batch.logits_indices = torch.arange(n - 1)
        z = model.mtp(model.embed(torch.tensor(tokens[1:])), hidden[:-1], batch, mtp_cache)
        return model.compute_logits(z)


def test_mtp_drafts_are_the_mtp_layer_run_over_the_whole_sequence(tiny_mtp_dir, monkeypatch):
    """Each first draft the engine made -- after prefill chunks, plain decodes and verifies
    with kept and rejected drafts -- is the argmax of the MTP layer run once over the final
    sequence at the position before the request's last token: the drafter's incremental
    MTP cache and positions are right."""
    import oxserve.engine.scheduler

    # the guard off: k drafts at every decode
    monkeypatch.setattr(oxserve.engine.scheduler, "draft_depth", lambda request, k, floor: k)
    monkeypatch.setattr(oxserve.engine.scheduler.DraftCost, "budget", lambda self, decodes: (0.5, 99))
    rng = random.Random()
    prompt = [rng.randrange(20, 8000) for _ in range(rng.randrange(30, 80))]
    llm = LLM(model=str(tiny_mtp_dir), dtype="float32", speculative_config=MTP_SPEC, kda_replay_len=4,
              max_num_batched_tokens=24, block_size=16)  # fmt: skip
    seen: list[tuple[int, int]] = []  # (tokens the request had, its first draft)
    propose = llm.engine.runner.propose_drafts

    def spy(wanted):
        drafts = propose(wanted)
        for rid, d in drafts.items():
            seen.append((llm.engine.scheduler.requests[rid].num_tokens, d[0]))
        return drafts

    llm.engine.runner.propose_drafts = spy
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))[0].outputs[0]
    sequence = prompt + out.token_ids
    logits = _teacher_forced_first_drafts(tiny_mtp_dir, sequence)
    assert len(seen) > 20
    for num_tokens, draft in seen:
        row = logits[num_tokens - 2]  # the MTP position before the last token
        best = float(row.max())
        assert float(row[draft]) > best - 1e-4, f"draft after {num_tokens} tokens is not the MTP argmax"


@pytest.mark.slow
def test_64_concurrent_greedy_requests_with_mtp_equal_their_solo_runs(tiny_mtp_dir):
    """The concurrency guarantee with speculation on: batched with 63 others (chunked
    prefill, drafts accepted and rejected in the same steps) a greedy request yields the
    tokens it yields alone, up to picks that fp32 rounding can flip."""
    rng = random.Random()
    prompts = [[rng.randrange(20, 8000) for _ in range(rng.randrange(1, 40))] for _ in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    llm = LLM(model=str(tiny_mtp_dir), dtype="float32", speculative_config=MTP_SPEC, max_num_seqs=64,
              max_num_batched_tokens=256)  # fmt: skip
    together = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert llm.engine.stats().spec_draft_tokens > 0
    for prompt, batched in zip(prompts, together):
        alone = llm.generate([prompt], params)[0].outputs[0]
        first = _first_difference(alone, batched)
        if first is not None:
            top = sorted(alone.logprobs[first].values(), reverse=True)
            assert top[0] - top[1] < 1e-4, f"diverged at token {first} (margin {top[0] - top[1]:.3g})"
