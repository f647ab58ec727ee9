"""Speculative decoding: the proposer, rejection sampling against direct sampling, and the
engine's verify-and-rollback path against plain decoding."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch

from oxserve import LLM, SamplingParams
from oxserve.engine import sampler, scheduler
from oxserve.engine.sampler import SamplingRow
from oxserve.engine.spec_guard import MAX_DEPTH, MIN_FLOOR
from oxserve.engine.speculative import SpeculativeConfig, lookup_replay, ngram_drafts, verify
from test_sampler import TV_TOLERANCE, _tv, ref_distribution

SPEC = '{"method": "ngram", "num_speculative_tokens": 4}'


def test_ngram_drafts_follow_the_latest_longest_match():
    history = [5, 6, 7, 1, 2, 5, 6, 9, 3, 5, 6]
    assert ngram_drafts(history, 2, 4, 1) == [9, 3]  # "5 6" last occurred before "9 3"
    assert ngram_drafts(history, 5, 4, 1) == [9, 3, 5, 6]  # no further than the history goes
    assert ngram_drafts([1, 2, 3, 4], 3, 4, 1) == []  # nothing repeats
    assert ngram_drafts([4, 8, 4], 3, 4, 2) == []  # a 1-token match is below prompt_lookup_min
    assert ngram_drafts([4, 8, 4], 3, 4, 1) == [8, 4]


def test_lookup_replay_counts_what_ngram_speculation_does_on_a_known_output():
    config = SpeculativeConfig("ngram", 3)
    # An output that continues its prompt's cycle: every draft is kept, k + 1 tokens a step.
    cycle = [10, 11, 12, 13, 14]
    steps, drafted, accepted = lookup_replay(cycle * 2, cycle * 3 + [10], config)
    assert accepted == drafted and steps == -(-15 // 4)
    # Tokens never seen before: nothing to look up, one token a step.
    assert lookup_replay([1, 2, 3], [20, 21, 22, 23, 24], config) == (4, 0, 0)
    # By hand: after 7, drafts 8 9 7 and keeps 8; after 5 (never seen), none; after 7, room for
    # one more draft before the end: 8, kept.
    assert lookup_replay([7, 8, 9, 7, 8, 9], [7, 8, 5, 7, 8, 9], config) == (3, 4, 2)


def test_lookup_replay_drafts_and_keeps_what_the_engine_does_at_full_depth(monkeypatch):
    """The engine's n-gram speculation with its guard pinned to full depth (every decode
    drafts all it may), one request at a time, on held-out code through the trained default
    model (whose continuations repeat their context often enough to keep drafts): the draft
    and accepted tokens it counts are the ones `lookup_replay` predicts from the prompt and
    the output alone."""
    from oxserve.default_model import default_model
    from oxserve.default_model.train import held_out_windows
    from oxserve.engine import scheduler
    from oxserve.engine.spec_guard import MAX_DEPTH, MIN_FLOOR

    monkeypatch.setattr(scheduler, "draft_depth", lambda request, k, floor: k)
    monkeypatch.setattr(scheduler.DraftCost, "budget", lambda self, decodes: (MIN_FLOOR, MAX_DEPTH))
    config = SpeculativeConfig("ngram", 3, prompt_lookup_max=3)
    llm = LLM(model=str(default_model()), dtype="float32", speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}))
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    predicted = [0, 0]
    for prompt in held_out_windows(default_model(), 4, 96, random.randrange(2**31)):
        before = llm.engine.stats()
        (out,) = llm.generate([prompt], params)
        after = llm.engine.stats()
        _, drafted, accepted = lookup_replay(prompt, list(out.outputs[0].token_ids), config)
        assert (after.spec_draft_tokens - before.spec_draft_tokens, after.spec_accepted_tokens - before.spec_accepted_tokens) \
            == (drafted, accepted)
        predicted = [predicted[0] + drafted, predicted[1] + accepted]
    counted = [after.spec_draft_tokens, after.spec_accepted_tokens]
    assert counted == predicted and 0 < predicted[1] < predicted[0]  # drafts kept and drafts rejected


@pytest.mark.parametrize("text, problem", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "not supported"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', ">= 1"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}', "unknown field"),
    ("ngram", "not JSON"),
])
def test_bad_speculative_configs_are_refused(text, problem):
    with pytest.raises(ValueError, match=problem):
        SpeculativeConfig.parse(text)


@pytest.mark.slow
def test_rejection_sampling_keeps_the_target_distribution():
    """The first token out is distributed as the target samples it directly; after an
    accepted draft, the next one is distributed as the target samples it with the draft in
    its output (penalties count it)."""
    torch.manual_seed(11)
    vocab = 8
    logits = torch.randn(3, vocab) * 1.5
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95, frequency_penalty=0.7, seed=None)
    row = SamplingRow(params, [1, 2], [3, 3], torch.Generator().manual_seed(random.SystemRandom().randrange(2**31)))
    first_ref = ref_distribution(logits[0], row)
    d0 = int(first_ref.argmax())
    d1 = int(ref_distribution(logits[1], SamplingRow(params, [1, 2], [3, 3, d0], None)).argsort()[-2])
    firsts, seconds = Counter(), Counter()
    draws = 20_000
    for _ in range(draws):
        out = verify(logits, [d0, d1], row).token_ids
        firsts[out[0]] += 1
        if out[0] == d0:
            seconds[out[1]] += 1
    def freq(counts):
        total = sum(counts.values())
        return torch.tensor([counts[t] / total for t in range(vocab)], dtype=torch.float64)
    assert _tv(freq(firsts), first_ref) < TV_TOLERANCE
    second_ref = ref_distribution(logits[1], SamplingRow(params, [1, 2], [3, 3, d0], None))
    assert sum(seconds.values()) > 5_000
    assert _tv(freq(seconds), second_ref) < TV_TOLERANCE


def test_sampled_verification_keeps_the_torch_forms_tokens(monkeypatch):
    """Verification filters natively on CPU (`filtered_weights`): on fresh random logits,
    drafts and filters, with the same generator states it yields the tokens the torch form
    (`filtered_probs`) yields, but where e^x's last bits move an acceptance across its
    uniform number or a weight across a cut (at most 3 of 300 requests)."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    vocab, differ = 500, 0
    for request in range(300):
        n = int(torch.randint(1, 5, (1,), generator=gen))
        logits = torch.randn(n + 1, vocab, generator=gen) * (0.5 + 3 * float(torch.rand(1, generator=gen)))
        pick = int(torch.randint(0, 3, (1,), generator=gen))  # drafts among each row's three likeliest
        drafts = [int(t) for t in logits[:n].argsort(dim=1, descending=True)[:, pick]]
        params = SamplingParams(temperature=0.3 + 1.5 * float(torch.rand(1, generator=gen)), top_p=0.9,
                                top_k=50 if request % 2 else 0, min_p=0.02 if request % 3 == 0 else 0.0)  # fmt: skip
        native = verify(logits, drafts, SamplingRow(params, [1], [2], torch.Generator().manual_seed(request))).token_ids
        with monkeypatch.context() as m:
            m.setattr(sampler, "sample_fit", lambda x: False)
            torch_form = verify(logits, drafts, SamplingRow(params, [1], [2], torch.Generator().manual_seed(request))).token_ids
        differ += native != torch_form
    assert differ <= 3, f"{differ} of 300 differ (seed {seed})"


def test_greedy_verification_keeps_drafts_up_to_the_first_miss():
    logits = torch.full((4, 10), -5.0)
    for i, best in enumerate([4, 7, 2, 9]):
        logits[i, best] = 5.0
    row = SamplingRow(SamplingParams(temperature=0.0, logprobs=1), [1], [], None)
    assert verify(logits, [4, 7, 2], row).token_ids == [4, 7, 2, 9]  # all kept, plus one more
    verified = verify(logits, [4, 1, 2], row)
    assert verified.token_ids == [4, 7]  # the miss is replaced by the target's own pick
    assert [next(iter(lp)) for lp in verified.logprobs] == [4, 7]


class HistoryProposer:
    """A test proposer that drafts from each request's history alone, as n-gram lookup does."""

    def propose(self, wanted):
        return {r.request_id: self.draft(r.prompt_token_ids + r.output_token_ids, k) for r, k in wanted}


def pin_the_guard(monkeypatch) -> None:
    """Draft rows always pay: the guard's measured step costs follow the machine's load (a
    busy machine can make it stop drafting), and these tests are about what drafts do."""
    monkeypatch.setattr(scheduler.DraftCost, "budget", lambda self, decodes: (MIN_FLOOR, MAX_DEPTH))


class OracleProposer(HistoryProposer):
    """Drafts from known continuations, some tokens deliberately wrong: accepted and
    rejected drafts in every run."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], wrong: float, seed: int):
        self.continuations, self.wrong, self.rng = continuations, wrong, random.Random(seed)

    def draft(self, history: list[int], k: int) -> list[int]:
        for prompt, output in self.continuations.items():
            if tuple(history[: len(prompt)]) == prompt:
                done = len(history) - len(prompt)
                if history[len(prompt) :] != output[:done]:
                    return []
                drafts = output[done : done + k]
                return [t if self.rng.random() > self.wrong else (t + 1) % 8000 for t in drafts]
        return []  # a sampled history that left the known continuation


@pytest.mark.slow
def test_speculative_greedy_equals_plain_greedy(tiny_model_dir, monkeypatch, kda_replay_len=5):
    """Drafts accepted and rejected at random, rings folding (length 5 is k + 1), prompts
    chunked around verifies by a small token budget, preemption, penalties that count every
    output token (kept drafts included): the same tokens as plain greedy decoding, so
    nothing a rejection undid leaves a trace."""
    pin_the_guard(monkeypatch)
    rng = random.Random()
    prompts = [[rng.randrange(20, 8000) for _ in range(rng.randrange(1, 90))] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True, logprobs=2,
                            repetition_penalty=1.2, presence_penalty=-2.0, frequency_penalty=1.0)
    options = dict(dtype="float32", max_num_batched_tokens=48, block_size=16, num_blocks=60, max_model_len=256)
    plain = [o.outputs[0] for o in LLM(model=str(tiny_model_dir), **options).generate(prompts, params)]
    llm = LLM(model=str(tiny_model_dir), speculative_config=SPEC, kda_replay_len=kda_replay_len, **options)
    llm.engine.proposer = OracleProposer({tuple(p): o.token_ids for p, o in zip(prompts, plain)}, 0.3, rng.randrange(99))
    spec = [o.outputs[0] for o in llm.generate(prompts, params)]
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    for a, b in zip(plain, spec):
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if first is not None:  # only a pick that fp32 rounding can flip may differ
            top = sorted(a.logprobs[first].values(), reverse=True)
            assert top[0] - top[1] < 1e-4, f"diverged at token {first} (margin {top[0] - top[1]:.3g})"
        assert len(b.token_ids) == len(a.token_ids) == 120


class EchoProposer(HistoryProposer):
    """Drafts the last token k times: mostly rejected, sometimes not."""

    def draft(self, history: list[int], k: int) -> list[int]:
        return history[-1:] * k


def test_speculative_sampling_stops_at_its_limits(tiny_model_dir):
    """Seeded sampling with drafts: outputs stop at max_tokens and at the context limit,
    never past them, and the same seed gives the same output."""
    rng = random.Random(3)
    prompts = [[rng.randrange(20, 8000) for _ in range(36)], [rng.randrange(20, 8000) for _ in range(10)]]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, seed=5, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=SPEC, max_model_len=64)
        llm.engine.proposer = EchoProposer()
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert llm.engine.stats().spec_draft_tokens > 0
    assert len(runs[0][0]) == 64 - 36  # the context limit
    assert len(runs[0][1]) == 40
    assert runs[0] == runs[1]


def test_deterministic_mode_refuses_speculation(tiny_model_dir):
    with pytest.raises(ValueError, match="deterministic"):
        LLM(model=str(tiny_model_dir), speculative_config=SPEC, deterministic=True)


def test_drafting_backs_off_when_drafts_are_rejected(tiny_model_dir):
    """Drafts that are always wrong: the request's acceptance estimate falls below any
    floor (at least MIN_FLOOR) within 13 verifies, and it probes with one draft every
    PROBE_INTERVAL decodes after, so almost every one of 300 decodes is plain."""
    from oxserve.engine.spec_guard import MIN_FLOOR, PROBE_INTERVAL

    class Wrong(HistoryProposer):
        def draft(self, history, k):
            return [0] * k  # token 0 (end of text, never sampled by ignore_eos greedy here)

    llm = LLM(model=str(tiny_model_dir), dtype="float32", speculative_config=SPEC)
    llm.engine.proposer = Wrong()
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=301, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats.spec_accepted_tokens == 0
    assert MIN_FLOOR >= 0.1  # what the bound below assumes: 13 misses take the estimate under it
    assert stats.spec_drafts <= 13 + 300 // PROBE_INTERVAL + 1
    assert stats.spec_draft_tokens <= 4 * 13 + 300 // PROBE_INTERVAL + 1
