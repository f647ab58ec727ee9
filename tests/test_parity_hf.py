"""oxserve against HF transformers 5.23.0 (fp32, CPU) on random tiny glm5_next models."""

from __future__ import annotations

import random

import pytest

from hf_reference import (
    CONFIGS,
    LOGIT_TOL,
    OxserveChoices,
    build_reference,
    check_generation,
    near_ties,
    record_comparison,
    reference_run,
    tiny_config,
)
from oxserve import LLM, SamplingParams
from oxserve.llm import run_to_completion
from oxserve_forward import DEFAULT_KERNEL, ForcedRun


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def reference(request, tmp_path_factory):
    seed = random.SystemRandom().randrange(2**31)  # fresh weights every run; printed on failure
    print(f"reference {request.param} seed {seed}")
    return build_reference(request.param, tmp_path_factory.mktemp(request.param), seed)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 512) for _ in range(n)]


# Chunks of 1, 7 and 13 put pool boundaries (k-pool 4 and 16) and KDA chunk boundaries in the
# middle of a prefill chunk; decode_from switches to one-token decode steps part way. Steps of
# one token on a cached context are decodes: with `replay` (a ReplaySSM ring length), their
# KDA layers replay from checkpoints, folding every `replay` steps.
@pytest.mark.parametrize(
    "length,chunk,decode_from,replay",
    [(1, 64, None, 0), (5, 64, None, 0), (37, 16, None, 0), (37, 1, None, 0), (100, 7, None, 0), (200, 64, None, 0),
     (230, 13, None, 0), (700, 700, None, 0), (700, 96, None, 0), (90, 13, 41, 0), (37, 1, None, 16), (90, 13, 41, 3)],
)
def test_prompt_logits_match(reference, length, chunk, decode_from, replay, linear_kernel=DEFAULT_KERNEL):
    rng = random.Random()
    tokens = _prompt(rng, length)
    hf = reference_run(reference, tokens)
    run = ForcedRun(reference.path, linear_kernel=linear_kernel)
    choices = OxserveChoices(run.model, forced={"0": near_ties(hf)})
    ours = run.logits(tokens, chunk, decode_from, kda_replay=replay)
    n, _ = choices.first_divergence("0", hf, length)  # fails on a pick that differs with a clear margin
    assert n == length
    record_comparison(n, length, choices.num_forced)
    scale = float(hf.logits.abs().max())
    err = float((ours - hf.logits).abs().max())
    assert err <= LOGIT_TOL * scale, f"max |dlogit| {err:.3g} at scale {scale:.3g} over {n} positions"


@pytest.mark.parametrize("linear_kernel", ["torch", "onednn"])
def test_each_linear_kernel_matches_hf(reference, linear_kernel):
    """Both kernels stay selectable and both match."""
    test_prompt_logits_match(reference, 90, 13, 41, 0, linear_kernel)


@pytest.mark.parametrize("options", [dict(linear_conv_kernel_dim=1, index_kpool=1, index_topk=8), dict(n_shared_experts=0)])
def test_edge_shapes_match_hf(options, tmp_path):
    """A 1-wide conv (no conv state at all), pools of one token, no shared expert."""
    reference = build_reference("edge", tmp_path, random.SystemRandom().randrange(2**31), tiny_config(**options))
    tokens = _prompt(random.Random(), 90)
    hf = reference_run(reference, tokens)
    run = ForcedRun(reference.path)
    choices = OxserveChoices(run.model, forced={"0": near_ties(hf)})
    ours = run.logits(tokens, 13, decode_from=70)
    assert choices.first_divergence("0", hf, len(tokens))[0] == len(tokens)
    record_comparison(len(tokens), len(tokens), choices.num_forced)
    assert float((ours - hf.logits).abs().max()) <= LOGIT_TOL * float(hf.logits.abs().max())


def _engine(reference, forced, **kw) -> tuple[LLM, OxserveChoices]:
    llm = LLM(model=str(reference.path), dtype="float32", **kw)
    choices = OxserveChoices(llm.engine.runner.model, forced)
    choices.watch_runner(llm.engine.runner)
    return llm, choices


GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=1)
LENGTHS = [1, 3, 17, 40, 64, 100, 150, 260]
_IDS = [f"r{i}" for i in range(len(LENGTHS))]


def _generate(**options):
    """A generation of all prompts as one batch under the request ids _IDS."""

    def generate(reference, prompts, forced):
        llm, choices = _engine(reference, forced, **options)
        for rid, prompt in zip(_IDS, prompts):
            llm.engine.add_request(rid, prompt, GREEDY)
        return run_to_completion(llm.engine, set(_IDS)), choices

    return generate


def _check(reference, prompts, generate) -> None:
    check_generation(reference, lambda forced: generate(reference, prompts, forced), dict(zip(_IDS, prompts)))


# The engine-level runs split between the two ways of decoding KDA (ReplaySSM rings short
# enough to fold many times in 64 tokens); the forced-logits cases above cover both too.
REPLAY = dict(kda_decode="replay", kda_replay_len=5)


@pytest.mark.slow
@pytest.mark.parametrize("budget,options", [(2048, {}), (64, REPLAY)], ids=["whole_prefill", "chunked_64_replay"])
def test_batched_greedy_matches_hf(reference, budget, options):
    rng = random.Random()
    prompts = [_prompt(rng, n) for n in LENGTHS]
    _check(reference, prompts, _generate(max_num_batched_tokens=budget, **options))


@pytest.mark.slow
def test_arrivals_during_decode_match_hf(reference):
    rng = random.Random()
    prompts = [_prompt(rng, n) for n in LENGTHS]
    arrivals = random.Random().randrange(2**31)  # the same arrival pattern in every round

    def generate(reference, prompts, forced):
        llm, choices = _engine(reference, forced, max_num_batched_tokens=96, **REPLAY)
        engine, pattern = llm.engine, random.Random(arrivals)
        finished = {}
        pending = list(zip(_IDS, prompts))
        while pending or engine.has_unfinished_requests():
            for _ in range(pattern.randrange(1, 3)):
                if pending:
                    engine.add_request(*pending.pop(0), GREEDY)
            for _ in range(pattern.randrange(1, 6)):
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
        return finished, choices

    _check(reference, prompts, generate)


@pytest.mark.slow
def test_preempted_requests_match_hf(reference):
    rng = random.Random()
    prompts = [_prompt(rng, n) for n in LENGTHS]
    preemptions = []

    def generate(reference, prompts, forced):
        # 12 blocks of 32 tokens cannot hold all eight requests: some are preempted and recomputed.
        llm, choices = _engine(reference, forced, max_num_batched_tokens=128, block_size=32, num_blocks=12,
                               kda_decode="replay")
        for rid, prompt in zip(_IDS, prompts):
            llm.engine.add_request(rid, prompt, GREEDY)
        outputs = run_to_completion(llm.engine, set(_IDS))
        preemptions.append(llm.engine.stats().num_preemptions)
        return outputs, choices

    _check(reference, prompts, generate)
    assert preemptions[-1] > 0
