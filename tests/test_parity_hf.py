"""oxserve against HF transformers 5.23.0 (fp32, CPU) on random tiny glm5_next models."""

from __future__ import annotations

import random

import pytest
import torch

from hf_reference import CONFIGS, LOGIT_TOL, build_reference, check_continuation, teacher_forced
from oxserve import LLM, SamplingParams
from oxserve.cache.tensors import allocate_layer_caches
from oxserve.model.batch import ForwardBatch
from oxserve.model.loader import load_model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def reference(request, tmp_path_factory):
    seed = random.SystemRandom().randrange(2**31)  # fresh weights every run; printed on failure
    print(f"reference {request.param} seed {seed}")
    return build_reference(request.param, tmp_path_factory.mktemp(request.param), seed)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 512) for _ in range(n)]


def _prefill_logits(path, tokens: list[int], chunk: int) -> torch.Tensor:
    """Run `tokens` through oxserve's model in chunks (exercises state and selection carry-over)."""
    loaded = load_model(path, dtype=torch.float32)
    block_size = 32
    blocks = -(-len(tokens) // block_size)
    caches = allocate_layer_caches(loaded.config, blocks + 3, block_size, 2, torch.float32, "cpu")
    # A scrambled block table: pages need not be contiguous or ordered.
    table = torch.randperm(blocks + 3)[:blocks].unsqueeze(0)
    outs = []
    for start in range(0, len(tokens), chunk):
        pos = torch.arange(start, min(start + chunk, len(tokens)))
        batch = ForwardBatch(
            query_lens=[len(pos)], context_lens=[start], num_decodes=0, positions=pos,
            request_index=torch.zeros_like(pos), slot_mapping=table[0][pos // block_size] * block_size + pos % block_size,
            block_tables=table, state_slots=torch.tensor([1]), block_size=block_size, logits_indices=torch.arange(len(pos)),
        )
        with torch.inference_mode():
            outs.append(loaded.model.compute_logits(loaded.model(torch.tensor(tokens)[pos], batch, caches)))
    return torch.cat(outs)


@pytest.mark.parametrize("length,chunk", [(1, 64), (5, 64), (37, 16), (200, 64), (700, 700), (700, 96)])
def test_prompt_logits_match(reference, length, chunk):
    rng = random.Random()
    tokens = _prompt(rng, length)
    ours = _prefill_logits(reference.path, tokens, chunk)
    hf_logits, first_tie, _ = teacher_forced(reference, tokens)
    n = first_tie
    scale = float(hf_logits.abs().max())
    err = float((ours[:n] - hf_logits[:n]).abs().max()) if n else 0.0
    assert err <= LOGIT_TOL * scale, f"max |dlogit| {err:.3g} at scale {scale:.3g} over {n} positions"


def _engine(reference, **kw) -> LLM:
    return LLM(model=str(reference.path), dtype="float32", **kw)


def _check_all(reference, prompts, outputs):
    for prompt, out in zip(prompts, outputs):
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        check_continuation(reference, prompt, out.outputs[0].token_ids, out.outputs[0].logprobs)


GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=1)
LENGTHS = [1, 3, 17, 40, 64, 100, 150, 260]


@pytest.mark.slow
@pytest.mark.parametrize("budget", [2048, 64], ids=["whole_prefill", "chunked_64"])
def test_batched_greedy_matches_hf(reference, budget):
    rng = random.Random()
    prompts = [_prompt(rng, n) for n in LENGTHS]
    llm = _engine(reference, max_num_batched_tokens=budget)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    _check_all(reference, prompts, outputs)


@pytest.mark.slow
def test_arrivals_during_decode_match_hf(reference):
    rng = random.Random()
    prompts = [_prompt(rng, n) for n in LENGTHS]
    llm = _engine(reference, max_num_batched_tokens=96)
    engine = llm.engine
    finished = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randrange(1, 3)):
            if pending:
                i, p = pending.pop(0)
                engine.add_request(f"r{i}", p, GREEDY)
        for _ in range(rng.randrange(1, 6)):
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
    _check_all(reference, prompts, [finished[f"r{i}"] for i in range(len(prompts))])


@pytest.mark.slow
def test_preempted_requests_match_hf(reference):
    rng = random.Random()
    prompts = [_prompt(rng, n) for n in LENGTHS]
    # 12 blocks of 32 tokens cannot hold all eight requests: some are preempted and recomputed.
    llm = _engine(reference, max_num_batched_tokens=128, block_size=32, num_blocks=12)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    _check_all(reference, prompts, outputs)
