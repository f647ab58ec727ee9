"""A step that raises fails only the request at fault: the engine recomputes the others, each
alone until it is past the failed step, and they give the answers they give when run solo.

Faults are planted through the reliability suite's seam (`OXSERVE_FAULTS`) or as a forward
hook on the model; the prompts, the poisoned request and the failing step are drawn afresh."""

from __future__ import annotations

import json
import random

import pytest

from oxserve.faults import FAULTS_ENV
from oxserve.llm import LLM
from oxserve.sampling_params import SamplingParams

POISON = 7  # the prompts below draw their tokens from [20, 8000)
GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=2)


def _llm(tiny_model_dir, **options) -> LLM:
    base = dict(dtype="float32", block_size=4, max_model_len=256, max_num_batched_tokens=24)
    return LLM(model=str(tiny_model_dir), **{**base, **options})


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(20, 8000) for _ in range(rng.randrange(8, 40))] for _ in range(n)]


def _solo(llm: LLM, prompts: list[list[int]], max_tokens: list[int]):
    return [llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=m, **GREEDY))[0].outputs[0]
            for p, m in zip(prompts, max_tokens)]  # fmt: skip


def _together(llm: LLM, prompts: list[list[int]], max_tokens: list[int]):
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in max_tokens]
    return [out.outputs[0] for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _assert_nothing_held(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests() and engine.cache.num_holders == 0 and not engine.scheduler.requests


# Write-back in deterministic mode recomputes bit for bit. ReplaySSM folds its ring at other
# points when a request's output is recomputed as a prefill: fp32 rounding (as in prefix caching).
@pytest.mark.parametrize("options, tolerance", [(dict(deterministic=True), 0.0),
                                                (dict(deterministic=True, kda_decode="replay"), 2e-4)],
                         ids=["write-back", "replay"])  # fmt: skip
def test_a_poisoned_request_fails_alone_and_the_others_match_their_solo_runs(tiny_model_dir, monkeypatch, options, tolerance):
    """The poisoned request's token sits somewhere in its prompt, so some prefill chunk of it
    raises in whatever batch it shares. It alone finishes with "error"; every other request
    gives what it gives alone; the cache ends empty and the engine serves on."""
    rng = random.Random()
    monkeypatch.setenv(FAULTS_ENV, json.dumps({"poison_token": POISON}))
    llm = _llm(tiny_model_dir, **options)
    prompts = _prompts(rng, 6)
    bad = rng.randrange(len(prompts))
    prompts[bad].insert(rng.randrange(len(prompts[bad]) + 1), POISON)
    max_tokens = [rng.randrange(3, 12) for _ in prompts]
    together = _together(llm, prompts, max_tokens)
    assert together[bad].finish_reason == "error"
    clean = [i for i in range(len(prompts)) if i != bad]
    solo = _solo(llm, [prompts[i] for i in clean], [max_tokens[i] for i in clean])
    for i, alone in zip(clean, solo):
        assert together[i].finish_reason == "length" and together[i].token_ids == alone.token_ids, i
        for ours, theirs in zip(together[i].logprobs, alone.logprobs):
            assert ours.keys() == theirs.keys() and all(abs(ours[t] - theirs[t]) <= tolerance for t in ours), i
    _assert_nothing_held(llm)
    assert llm.generate([{"prompt_token_ids": prompts[clean[0]]}], SamplingParams(max_tokens=2))[0].outputs[0].finish_reason


def test_a_transient_fault_in_a_batched_step_loses_nothing(tiny_model_dir):
    """One forward, drawn at random among the batched ones, raises once. Nobody fails: the
    requests in that step are recomputed and every answer equals the request's solo run."""
    rng = random.Random()
    llm = _llm(tiny_model_dir, deterministic=True)
    prompts = _prompts(rng, 5)
    max_tokens = [rng.randrange(4, 12) for _ in prompts]
    solo = _solo(llm, prompts, max_tokens)
    calls, fail_at = [0], rng.randrange(2, 30)

    def once(module, args):
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("a transient fault")

    llm.engine.runner.model.register_forward_pre_hook(once)
    together = _together(llm, prompts, max_tokens)
    assert calls[0] > fail_at
    assert [o.token_ids for o in together] == [o.token_ids for o in solo]
    assert [o.logprobs for o in together] == [o.logprobs for o in solo]
    _assert_nothing_held(llm)


def test_a_fault_that_needs_company_serialises_instead_of_looping(tiny_model_dir):
    """A fault in every forward of two or more requests never shows alone: nobody is failed,
    the requests end up running one at a time (after a bounded number of failed steps) and
    all finish."""
    rng = random.Random()
    llm = _llm(tiny_model_dir)
    failures = [0]

    def only_in_company(module, args):
        if args[1].num_requests >= 2:
            failures[0] += 1
            raise RuntimeError("fails whenever batched")

    llm.engine.runner.model.register_forward_pre_hook(only_in_company)
    prompts = _prompts(rng, 4)
    max_tokens = [rng.randrange(3, 8) for _ in prompts]
    together = _together(llm, prompts, max_tokens)
    assert [o.finish_reason for o in together] == ["length"] * len(prompts)
    assert [len(o.token_ids) for o in together] == max_tokens
    assert 1 <= failures[0] <= 3 * len(prompts)
    _assert_nothing_held(llm)
