"""Prompt logprobs (SamplingParams.prompt_logprobs): computed in the prefill pass, through
chunking and preemption, equal to one full-sequence forward's log_softmax and to HF's."""

from __future__ import annotations

import random

import pytest
import torch
from hf_reference import (
    LOGPROB_TOL,
    OxserveChoices,
    build_reference,
    near_ties,
    record_comparison,
    reference_run,
)
from tiny_models import TINY_TEXT_CONFIG

from oxserve import LLM, SamplingParams
from oxserve.default_model import build_checkpoint
from oxserve.llm import run_to_completion
from oxserve.model.forced import forced_logits

K = 3
SCORE = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=K)
PROMPT = [(37 * i + 11) % 8000 + 100 for i in range(70)]


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory):
    """The tiny model with sparse attention that keeps every token: ulp-level differences
    between chunkings cannot flip the DSA selection (ReLU scores tie at 0 on random weights)."""
    return build_checkpoint(tmp_path_factory.mktemp("dense-dsa"), {**TINY_TEXT_CONFIG, "index_topk": 512}, seed=3,
                            dtype=torch.float32)  # fmt: skip


@pytest.fixture(scope="module")
def whole(dense_model):
    """Prompts prefilled in one step each."""
    return LLM(model=str(dense_model), dtype="float32", max_model_len=256)


def _check(out, prompt: list[int], expected: torch.Tensor, k: int, tol: float) -> None:
    """One entry per prompt token: None first, then the prompt token's logprob and the top-k
    values of `expected` [len(prompt) - 1, V] (ids may swap at ties), and a rank that
    `expected` allows within `tol`."""
    assert len(out.prompt_logprobs) == len(out.prompt_token_ranks) == len(prompt)
    assert out.prompt_logprobs[0] is None and out.prompt_token_ranks[0] is None
    for t in range(1, len(prompt)):
        entry, rank, row, token = out.prompt_logprobs[t], out.prompt_token_ranks[t], expected[t - 1], prompt[t]
        assert next(iter(entry)) == token and len(entry) in (k, k + 1), f"token {t}"  # the prompt token, then the top-k
        assert abs(entry[token] - float(row[token])) <= tol, f"token {t}: {entry[token]} vs {float(row[token])}"
        assert sorted(entry.values())[-k:] == pytest.approx(sorted(row.topk(k).values.tolist()), abs=tol), f"token {t}"
        assert int((row > row[token] + tol).sum()) < rank <= int((row >= row[token] - tol).sum()), f"token {t}"


def _full_forward(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """log_softmax of one unchunked forward over the prompt: the distribution after each position."""
    return torch.log_softmax(forced_logits(llm.engine.runner.model, prompt, chunk=len(prompt)), dim=-1)[:-1]


def test_prompt_logprobs_are_the_full_forward_log_softmax(whole):
    out = whole.generate({"prompt_token_ids": PROMPT}, SCORE)[0]
    full = _full_forward(whole, PROMPT)
    _check(out, PROMPT, full, K, 1e-5)  # the same math, rounded differently at most
    last = torch.log_softmax(forced_logits(whole.engine.runner.model, PROMPT, chunk=len(PROMPT))[-1], dim=-1)
    assert out.outputs[0].token_ids[0] == int(last.argmax())  # sampling is as without prompt logprobs


def test_offline_api_returns_them_only_when_asked(whole):
    plain, one, two = whole.generate(
        [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": [5]}, {"prompt_token_ids": PROMPT[:9]}],
        [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, prompt_logprobs=0),
         SamplingParams(max_tokens=2, prompt_logprobs=1, n=2, seed=4)],
    )  # fmt: skip
    assert plain.prompt_logprobs is None and plain.prompt_token_ranks is None
    assert one.prompt_logprobs == [None] and one.prompt_token_ranks == [None]  # nothing before the only token
    _check(two, PROMPT[:9], _full_forward(whole, PROMPT[:9]), 1, 1e-5)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


# A budget of 16 or 7 tokens splits the prompt over several steps (each chunk's last position
# scores the next chunk's first token); deterministic mode feeds one token per step.
@pytest.mark.parametrize("options", [{"max_num_batched_tokens": 16}, {"max_num_batched_tokens": 7, "max_stall": 0},
                                     {"deterministic": True}], ids=["chunks_16", "chunks_7", "deterministic"])  # fmt: skip
def test_chunked_prefill_gives_the_same_values(dense_model, whole, options):
    chunked = LLM(model=str(dense_model), dtype="float32", max_model_len=256, **options)
    out = chunked.generate({"prompt_token_ids": PROMPT}, SCORE)[0]
    _check(out, PROMPT, _full_forward(whole, PROMPT), K, LOGPROB_TOL)


# Six blocks of 16 tokens: B is preempted in the middle of its prompt (some tokens scored),
# and restarted more than once; with seven, B is preempted while decoding, its prompt done.
@pytest.mark.parametrize("num_blocks,b_tokens,mid_prompt", [(6, 4, True), (7, 30, False)])
def test_preemption_recomputes_without_duplicates(dense_model, whole, num_blocks, b_tokens, mid_prompt):
    a, b = PROMPT[:40], PROMPT[10:]
    b_params = SamplingParams(temperature=0.0, max_tokens=b_tokens, ignore_eos=True, prompt_logprobs=K)
    reference = whole.generate({"prompt_token_ids": b}, b_params)[0]
    llm = LLM(model=str(dense_model), dtype="float32", block_size=16, num_blocks=num_blocks,
              max_num_batched_tokens=16, max_stall=0)  # fmt: skip
    engine = llm.engine
    engine.add_request("A", {"prompt_token_ids": a}, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.add_request("B", b, b_params)
    request = engine.scheduler.requests["B"]
    scored_at_preemption, outputs = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.prompt_logprobs is None or len(out.prompt_logprobs) == len(b)
            outputs[out.request_id] = out
        if request.num_preemptions > len(scored_at_preemption):
            scored_at_preemption.append(len(request.prompt_logprobs))
    assert scored_at_preemption, "the cache was meant to be tight enough to preempt B"
    assert any(1 < n < len(b) for n in scored_at_preemption) == mid_prompt
    out = outputs["B"]
    _check(out, b, _full_forward(whole, b), K, LOGPROB_TOL)
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids


def test_requests_without_prompt_logprobs_are_unchanged(dense_model):
    """A batch where some requests score their prompt and others do not samples the same
    tokens, with the same logprobs, as that batch with none scoring."""
    llm = LLM(model=str(dense_model), dtype="float32", max_model_len=256, max_num_batched_tokens=24, max_stall=0)
    prompts = [{"prompt_token_ids": PROMPT[i : i + n]} for i, n in [(0, 30), (5, 50), (9, 12), (20, 41)]]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    mixed = [greedy, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1, prompt_logprobs=2)] * 2
    without = llm.generate(prompts, greedy)
    assert llm.engine.reset_prefix_cache()  # the second batch computes what the first did, not resumes from it
    scored = llm.generate(prompts, mixed)
    for a, b in zip(without, scored):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    assert [o.prompt_logprobs is None for o in scored] == [True, False, True, False]


def test_prompt_logprobs_match_hf(tmp_path):
    """Against HF transformers' glm5_next (fp32) on a random tiny model, chunked prefill:
    every prompt token's logprob and the top-k values, within the suite's logprob tolerance."""
    seed = random.SystemRandom().randrange(2**31)
    print(f"reference seed {seed}")
    reference = build_reference("kpool4_shared", tmp_path, seed)
    rng = random.Random(seed)
    tokens = [rng.randrange(2, 512) for _ in range(90)]
    hf = reference_run(reference, tokens)
    llm = LLM(model=str(reference.path), dtype="float32", max_num_batched_tokens=13)
    choices = OxserveChoices(llm.engine.runner.model, forced={"0": near_ties(hf)})  # near ties taken HF's way
    choices.watch_runner(llm.engine.runner)
    llm.engine.add_request("0", {"prompt_token_ids": tokens}, SamplingParams(max_tokens=1, prompt_logprobs=K))
    out = run_to_completion(llm.engine, {"0"})["0"]
    assert choices.first_divergence("0", hf, len(tokens))[0] == len(tokens)
    record_comparison(len(tokens), len(tokens), choices.num_forced)
    _check(out, tokens, torch.log_softmax(hf.logits, dim=-1)[:-1], K, LOGPROB_TOL)
