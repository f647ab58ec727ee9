"""Speculative decoding with the checkpoint's MTP layer (`{"method": "mtp"}`)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from test_speculative import pin_the_guard
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


def test_mtp_greedy_equals_plain_greedy(tiny_mtp_dir, monkeypatch):
    """Chunked prompts, preemption, drafts near block ends: the same tokens as plain greedy."""
    pin_the_guard(monkeypatch)
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


def _drafting_every(monkeypatch, every: int) -> None:
    """The guard off: k drafts at every `every`-th decode step (none at the others, where the
    drafter leaves the MTP passes owed)."""
    import oxserve.engine.scheduler

    steps = itertools.count()
    monkeypatch.setattr(oxserve.engine.scheduler, "draft_depth", lambda request, k, floor: k)
    monkeypatch.setattr(oxserve.engine.scheduler.DraftCost, "budget",
                        lambda self, decodes: (0.5, 99) if every and next(steps) % every == 0 else None)  # fmt: skip
    monkeypatch.setattr(oxserve.engine.scheduler.DraftCost, "dear", lambda self, decodes: False)  # every pass runs


def _spy_first_drafts(llm, by_request: dict | None = None) -> list[tuple[int, int]]:
    """(tokens the request had, its first draft) of every proposal from now on; with
    `by_request`, also listed there by request id."""
    seen: list[tuple[int, int]] = []
    propose = llm.engine.runner.propose_drafts

    def spy(wanted):
        drafts = propose(wanted)
        for rid, d in drafts.items():
            seen.append((llm.engine.scheduler.requests[rid].num_tokens, d[0]))
            if by_request is not None:
                by_request.setdefault(rid, []).append(seen[-1])
        return drafts

    llm.engine.runner.propose_drafts = spy
    return seen


def _poison_mtp_cache(llm) -> None:
    """Large random MTP latents where nothing was written yet: a draft that reads an entry its
    pass never wrote is then far from the MTP layer's argmax."""
    with torch.inference_mode():
        llm.engine.runner.drafter.cache.latent.normal_(0.0, 30.0)


def _assert_mtp_argmax(path, sequence: list[int], seen: list[tuple[int, int]]) -> None:
    logits = _teacher_forced_first_drafts(path, sequence)
    for num_tokens, draft in seen:
        row = logits[num_tokens - 2]  # the MTP position before the last token
        best = float(row.max())
        assert float(row[draft]) > best - 1e-4, f"draft after {num_tokens} tokens is not the MTP argmax"


@pytest.mark.parametrize("every", [1, 5], ids=["every-step", "every-5th-step"])
@pytest.mark.parametrize("eager", [False, True], ids=["captured", "eager"])
def test_mtp_drafts_are_the_mtp_layer_run_over_the_whole_sequence(tiny_mtp_dir, monkeypatch, eager, every):
    """Each first draft the engine made -- after prefill chunks, plain decodes and verifies
    with kept and rejected drafts, and after steps that did not draft, whose MTP passes were
    owed and caught up -- is the argmax of the MTP layer run once over the final sequence at
    the position before the request's last token: the drafter's incremental MTP cache and
    positions are right, in captured passes as in eager ones."""
    _drafting_every(monkeypatch, every)
    rng = random.Random()
    prompt = [rng.randrange(20, 8000) for _ in range(rng.randrange(30, 80))]
    llm = LLM(model=str(tiny_mtp_dir), dtype="float32", speculative_config=MTP_SPEC, kda_replay_len=4,
              max_num_batched_tokens=24, block_size=16, enforce_eager=eager)  # fmt: skip
    seen = _spy_first_drafts(llm)
    drafter = llm.engine.runner.drafter
    caught_up = []
    propose = drafter.propose
    drafter.propose = lambda *a: [propose(*a), caught_up.append(drafter.catch_up_s)][0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True))[0].outputs[0]
    assert len(seen) > 40 // every
    assert (drafter.captured is None) == eager and (eager or drafter.captured.replays > 0)
    assert (max(caught_up) > 0) == (every > 1)  # passes over positions owed from earlier steps
    _assert_mtp_argmax(tiny_mtp_dir, prompt + out.token_ids, seen)


def test_requests_that_do_not_draft_run_the_mtp_layer_once_a_block(tiny_mtp_dir, monkeypatch):
    """Drafting off (as where the guard finds drafts do not pay): a request's MTP passes wait
    until a cache block fills, a few passes for 70 tokens rather than one a step. Every full
    block still gets its MTP entries in the step that fills it: a second request that finds
    them as a cached prefix, and drafts at every step, drafts what the MTP layer run over its
    whole sequence does."""
    _drafting_every(monkeypatch, 0)
    rng = random.Random()
    prompt = [rng.randrange(20, 8000) for _ in range(rng.randrange(20, 40))]
    llm = LLM(model=str(tiny_mtp_dir), dtype="float32", speculative_config=MTP_SPEC, block_size=16)
    _poison_mtp_cache(llm)
    drafter = llm.engine.runner.drafter
    passes = []
    run = drafter._run
    drafter._run = lambda rows, tables: [passes.append(len(rows)), run(rows, tables)][1]
    params = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
    first = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert len(passes) <= 2 + (len(prompt) + 70) // 16 and llm.engine.stats().spec_draft_tokens == 0
    _drafting_every(monkeypatch, 1)
    seen = _spy_first_drafts(llm)
    again = prompt + first
    out = llm.generate([again], params)[0].outputs[0]
    assert llm.engine.stats().prefix_hits >= 16 * (len(again) // 16 - 1) and len(seen) > 10
    _assert_mtp_argmax(tiny_mtp_dir, again + out.token_ids, seen)


def test_where_the_guard_finds_rows_dear_the_mtp_layer_runs_for_probes_only(tiny_mtp_dir, monkeypatch):
    """A batch size whose draft rows were measured to cost a step or more: no MTP pass runs
    for blocks, prompts or requests leaving (each a layer's prefill, which made MTP switched
    on slower than plain decode), only a probe's own passes, and a probe still drafts. A
    request with its own seed keeps every pass (its drafts must not depend on measured costs).
    The tokens are plain greedy's either way."""
    import oxserve.engine.scheduler

    measured_dear = oxserve.engine.scheduler.DraftCost.dear
    _drafting_every(monkeypatch, 8)  # the probes
    monkeypatch.setattr(oxserve.engine.scheduler.DraftCost, "dear", measured_dear)
    monkeypatch.setattr(oxserve.engine.scheduler.DraftCost, "observe", lambda self, *args, **kwargs: None)  # stays dear
    rng = random.Random()
    prompt = [rng.randrange(20, 8000) for _ in range(rng.randrange(20, 40))]
    options = dict(dtype="float32", block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
    plain = LLM(model=str(tiny_mtp_dir), **options).generate([prompt], params)[0].outputs[0].token_ids
    llm = LLM(model=str(tiny_mtp_dir), speculative_config=MTP_SPEC, **options)
    _poison_mtp_cache(llm)
    llm.engine.scheduler.draft_cost.row_cost[1] = 1.5  # batch 1: rows measured dear
    drafter = llm.engine.runner.drafter
    passes = []
    run = drafter._run
    drafter._run = lambda rows, tables: [passes.append(len(rows)), run(rows, tables)][1]
    out = llm.generate([prompt], params)[0].outputs[0].token_ids
    probes = llm.engine.stats().spec_drafts
    assert out == plain and probes > 0 and llm.engine.stats().spec_draft_tokens > 0
    assert len(passes) <= 3 * probes  # a probe: the pass over its last step's positions, k - 1 more for its drafts
    # Seeded, on a prompt of its own (no blocks shared with the first), drafting once in 16
    # decodes (its acceptance too low: the request's own probes): every draft is the MTP
    # layer's run over the whole sequence, so the passes between its drafts ran.
    monkeypatch.setattr(oxserve.engine.scheduler, "draft_depth", lambda request, k, floor: 0)
    seen = _spy_first_drafts(llm)
    other = [rng.randrange(20, 8000) for _ in range(30)]
    seeded = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, seed=5)
    out = llm.generate([other], seeded)[0].outputs[0].token_ids
    assert len(seen) >= 3
    _assert_mtp_argmax(tiny_mtp_dir, other + out, seen)


@pytest.mark.slow
def test_64_concurrent_greedy_requests_with_mtp_equal_their_solo_runs(tiny_mtp_dir, monkeypatch):
    """The concurrency guarantee with speculation on: batched with 63 others (chunked
    prefill, drafts accepted and rejected in the same steps) a greedy request yields the
    tokens it yields alone, up to picks that fp32 rounding can flip."""
    pin_the_guard(monkeypatch)
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


def test_drafts_after_preemption_are_the_mtp_layer_run_over_the_whole_sequence(tiny_mtp_dir, monkeypatch):
    """Requests preempted for lack of blocks while they owe MTP passes (drafting at most
    every third step), then resumed: their drafts, before and after, are the MTP layer's over
    the whole sequence."""
    _drafting_every(monkeypatch, 3)
    rng = random.Random()
    prompts = [[rng.randrange(20, 8000) for _ in range(rng.randrange(10, 20))] for _ in range(4)]
    llm = LLM(model=str(tiny_mtp_dir), dtype="float32", speculative_config=MTP_SPEC, block_size=16, num_blocks=20,
              max_num_seqs=4, prefix_checkpoint_policy="lru")  # fmt: skip
    _poison_mtp_cache(llm)
    by_request: dict[str, list[tuple[int, int]]] = {}
    _spy_first_drafts(llm, by_request)
    params = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)
    ids = [llm.engine.add_request(None, {"prompt_token_ids": p}, params) for p in prompts]
    outputs = {}
    while llm.engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in llm.engine.step() if o.finished})
    assert llm.engine.stats().num_preemptions > 0
    for rid, prompt in zip(ids, prompts):
        assert len(by_request[rid]) > 5
        _assert_mtp_argmax(tiny_mtp_dir, prompt + outputs[rid].outputs[0].token_ids, by_request[rid])


@pytest.mark.parametrize("prompt_len", [6, 16], ids=["partial-block-copied", "full-block-shared"])
def test_a_prompt_resumed_from_a_running_request_finds_the_mtp_entries_it_owed(tiny_mtp_dir, monkeypatch, prompt_len):
    """A request that does not draft owes the MTP passes of the positions in its last
    block; a second request whose prompt continues the first's output resumes at the
    first's prompt-end checkpoint while the first still runs: copying the block the prompt
    ends in, or, for a prompt of a whole block, sharing that block (whose MTP entries were
    written when the prompt filled it). Either way it finds the MTP entries: the second
    request, drafting at every step (it has a seed, so the guard is not asked), drafts what
    the MTP layer run over its whole sequence does."""
    _drafting_every(monkeypatch, 0)  # no drafts for requests without a seed
    rng = random.Random()
    prompt = [rng.randrange(20, 8000) for _ in range(prompt_len)]
    options = dict(dtype="float32", block_size=16, max_model_len=128)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    head = LLM(model=str(tiny_mtp_dir), enable_prefix_caching=False, **options).generate([prompt], greedy)[0]
    continued = prompt + head.outputs[0].token_ids[:5]
    llm = LLM(model=str(tiny_mtp_dir), speculative_config=MTP_SPEC, prefix_checkpoint_policy="lru", **options)
    _poison_mtp_cache(llm)
    seen = _spy_first_drafts(llm)
    engine = llm.engine
    engine.add_request("first", {"prompt_token_ids": prompt}, greedy)
    while len(engine.scheduler.requests["first"].output_token_ids) < 7:
        engine.step()
    assert engine.runner.drafter.owing() == ["first"]  # (its positions from the 17th on, with a 16-token prompt)
    engine.add_request("second", {"prompt_token_ids": continued},
                       SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, seed=1))  # fmt: skip
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.stats().prefix_hits == len(prompt) and len(seen) > 20
    assert outputs["first"].outputs[0].token_ids == head.outputs[0].token_ids
    _assert_mtp_argmax(tiny_mtp_dir, continued + outputs["second"].outputs[0].token_ids, seen)
