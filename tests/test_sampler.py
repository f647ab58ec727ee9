"""The sampler against plain per-row references written with loops."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from oxserve.engine.sampler import (SamplingRow, apply_penalties, filtered_probs, filtered_weights, greedy_tokens, inverse_cdf,
                                    make_generator, penalties_torch, sample, uniforms)
from oxserve.kernels.sampling import filter_native, sample_native
from oxserve.sampling_params import SamplingParams

# Total-variation tolerance for empirical vs. reference distributions. With N draws over
# V outcomes, E[TV] <= 0.5 * sqrt(V / N): 0.014 for V = 16, N = 20_000, so 0.03 leaves
# a wide margin while a wrong distribution (see the temperature test) lands far above it.
TV_TOLERANCE = 0.03


def _row(params: SamplingParams, prompt=(), output=(), generator=None) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), generator)


# --- references -------------------------------------------------------------------------


def ref_penalised(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    p = row.params
    x = logits.float().clone()
    for t in set(row.prompt_token_ids) | set(row.output_token_ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, count in Counter(row.output_token_ids).items():
        x[t] -= p.frequency_penalty * count
        x[t] -= p.presence_penalty
    return x


def ref_distribution(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Float64 distribution a non-greedy row samples from (zeros outside the allowed set).

    vLLM v1 order: temperature -> min-p -> top-k -> top-p, each renormalising what it keeps.
    """
    p = row.params
    probs = torch.softmax(ref_penalised(logits, row).double() / p.temperature, dim=-1)
    by_prob = sorted(range(len(probs)), key=lambda t: -probs[t].item())
    if p.min_p > 0.0:
        threshold = p.min_p * probs.max()
        for t in range(len(probs)):
            if probs[t] < threshold:
                probs[t] = 0.0
        probs /= probs.sum()
    if p.top_k > 0:
        for t in by_prob[p.top_k :]:
            probs[t] = 0.0
        probs /= probs.sum()
    if p.top_p < 1.0:
        kept, mass = [], 0.0
        for t in by_prob:
            if mass >= p.top_p:
                break
            kept.append(t)
            mass += probs[t].item()
        probs = torch.zeros_like(probs).index_fill(0, torch.tensor(kept), 1.0) * probs
        probs /= probs.sum()
    return probs


def _empirical(logits: torch.Tensor, row: SamplingRow, draws: int, batch: int = 2000) -> torch.Tensor:
    """Frequencies of `draws` samples, taken `batch` copies of the row at a time."""
    counts = torch.zeros(logits.shape[-1], dtype=torch.float64)
    for _ in range(draws // batch):
        out = sample(logits.expand(batch, -1), [row] * batch)
        counts += torch.bincount(torch.tensor(out.token_ids), minlength=len(counts))
    return counts / counts.sum()


def _tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * (p - q).abs().sum().item()


# --- greedy -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("logprobs", [None, 2])  # None: argmax fast path; 2: general path
def test_greedy_is_argmax_and_logits_untouched(dtype, logprobs):
    torch.manual_seed(0)
    logits = torch.randn(8, 100).to(dtype)
    logits[0, 3] = logits[0, 7] = logits[0].max() + 1  # a tie goes to the lowest index
    before = logits.clone()
    rows = [_row(SamplingParams(temperature=0.0, logprobs=logprobs)) for _ in range(8)]

    out = sample(logits, rows)

    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.token_ids[0] == 3
    assert torch.equal(logits, before)


def test_greedy_below_min_sampling_temperature():
    assert SamplingParams(temperature=9.9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy


@pytest.mark.parametrize("temperature", [1e-7, 9.9e-6, 1e-38])
def test_near_zero_temperature_is_greedy_on_penalised_logits(temperature):
    """Such a row is greedy, its top-k / top-p / min-p ignored, as in vLLM. (Dividing logits
    by 1e-38 instead overflows them to inf, and the softmax of those is NaN.)"""
    torch.manual_seed(8)
    logits = torch.randn(5, 100) * 3
    logits[:, 0] = logits.max() + 0.5  # the raw argmax, repeated in every row's output
    penalties = dict(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.4)
    params = [
        SamplingParams(temperature=temperature, **penalties),
        SamplingParams(temperature=temperature, logprobs=3, **penalties),
        SamplingParams(temperature=temperature, top_k=40, top_p=0.3, min_p=0.9, **penalties),
        SamplingParams(temperature=temperature, logprobs=0),
        SamplingParams(temperature=1.0, seed=3),  # a sampled row sharing the batch
    ]
    rows = [_row(p, prompt=[7], output=[0, 0, 9], generator=make_generator(p.seed, "cpu")) for p in params]
    raw = torch.log_softmax(logits, dim=-1)

    out = sample(logits, rows)

    for i, row in enumerate(rows[:4]):
        expected = ref_penalised(logits[i], row).argmax().item()
        assert out.token_ids[i] == expected, i
        if row.params.logprobs is not None:
            assert set(out.logprobs[i]) == {expected, *raw[i].topk(row.params.logprobs).indices.tolist()}
            for t, value in out.logprobs[i].items():
                assert value == pytest.approx(raw[i, t].item(), abs=1e-6)
    # Sanity: the penalties did move the argmax off token 0, so the check above sees them.
    assert 0 not in out.token_ids[:3] and out.token_ids[3] == 0
    # The plain greedy row alone takes the argmax fast path: same answer.
    assert sample(logits[3:4], [_row(SamplingParams(temperature=temperature))]).token_ids == [0]


# --- penalties --------------------------------------------------------------------------


def _penalty_rows(vocab: int) -> list[SamplingRow]:
    rng = random.Random(1)
    settings = [
        dict(repetition_penalty=1.3),
        dict(repetition_penalty=0.7),
        dict(frequency_penalty=0.6),
        dict(presence_penalty=-1.1),
        dict(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.9),
        dict(),  # neutral row sharing the batch
    ]
    rows = []
    for kwargs in settings:
        # Few distinct tokens, so repeats and prompt/output overlaps are common.
        prompt = [rng.randrange(vocab // 2) for _ in range(rng.randrange(0, 30))]
        output = [rng.randrange(vocab // 2) for _ in range(rng.randrange(1, 30))]
        rows.append(_row(SamplingParams(temperature=0.0, **kwargs), prompt, output))
    return rows


def test_penalties_match_reference():
    torch.manual_seed(1)
    logits = torch.randn(6, 64) * 3
    rows = _penalty_rows(64)
    before = logits.clone()

    got = apply_penalties(logits.clone(), rows)
    expected = torch.stack([ref_penalised(logits[i], row) for i, row in enumerate(rows)])

    # Same definitions; tolerance only covers float32 rounding of penalty * count.
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert sample(logits, rows).token_ids == expected.argmax(dim=-1).tolist()
    assert torch.equal(logits, before)


@pytest.mark.parametrize("penalty", [8.9e60, 1e38, 1e30, 5e-324, 1e-40])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 1e39])
def test_extreme_penalties_and_temperatures_leave_a_masked_row_its_allowed_tokens(penalty, temperature):
    """A grammar mask left two tokens, both in the prompt, and masked one the prompt also holds
    (3); a penalty or temperature past float32's range must not make the allowed ones -inf or
    the masked one NaN (the fuzzer's 500s: the row then sampled token 0, which the grammar
    refused inside the step)."""
    logits = torch.full((2, 40), float("-inf"))
    logits[:, 7], logits[:, 9] = -3.0, 2.0
    rows = [_row(SamplingParams(temperature=temperature, repetition_penalty=penalty, frequency_penalty=2.0,
                                seed=s), prompt=[7, 9, 3], output=[7]) for s in (0, 1)]
    for _ in range(20):
        assert set(sample(logits, rows).token_ids) <= {7, 9}
    penalised = apply_penalties(logits.clone(), rows)
    assert penalised[:, [7, 9]].isfinite().all() and penalised.isneginf().sum() == 2 * 38


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0, frequency_penalty=1.0),
        dict(temperature=0.0, presence_penalty=1.0, logprobs=1),
        dict(temperature=0.8, top_k=3, top_p=0.5, min_p=0.2, repetition_penalty=1.2),
    ],
)
def test_float32_logits_are_not_modified(kwargs):
    torch.manual_seed(7)
    logits = torch.randn(3, 50)
    before = logits.clone()
    sample(logits, [_row(SamplingParams(**kwargs), prompt=[1, 2], output=[2, 3, 3])] * 3)
    assert torch.equal(logits, before)


# --- top-k / top-p / min-p --------------------------------------------------------------

FILTER_SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=1.0, top_k=5),
    dict(temperature=0.7, top_p=0.8),
    dict(temperature=1.3, min_p=0.1),
    dict(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05),
    dict(temperature=1.0, top_p=1e-6),  # top-p still keeps the most likely token
    dict(temperature=1.2, top_k=6, repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=0.3),
]


def _filter_row(kwargs: dict) -> SamplingRow:
    return _row(SamplingParams(**kwargs), prompt=[0, 1, 2, 3], output=[1, 2, 2, 5, 5, 5])


def test_sampled_tokens_lie_in_allowed_set():
    torch.manual_seed(2)
    vocab = 200
    rows = [_filter_row(kwargs) for kwargs in FILTER_SETTINGS]
    for _ in range(50):
        logits = torch.randn(len(rows), vocab) * 2
        allowed = [ref_distribution(logits[i], row) > 0 for i, row in enumerate(rows)]
        for _ in range(4):
            out = sample(logits, rows)
            for i, token in enumerate(out.token_ids):
                assert allowed[i][token], (FILTER_SETTINGS[i], token)


@pytest.mark.parametrize("kwargs", FILTER_SETTINGS)
def test_empirical_distribution_matches_reference(kwargs):
    torch.manual_seed(3)
    logits = torch.randn(16) * 2
    row = _filter_row(kwargs)
    empirical = _empirical(logits, row, draws=20_000)
    assert _tv(empirical, ref_distribution(logits, row)) < TV_TOLERANCE


def test_min_p_filters_before_top_p():
    """Top-p counts mass after min-p has dropped and renormalised the tail (vLLM v1 order)."""
    logits = torch.tensor([0.2, 0.1, 0.4, 0.3]).log()
    row = _row(SamplingParams(temperature=1.0, min_p=0.3, top_p=0.75))
    # min-p drops 0.1 (< 0.3 * 0.4); on (2, 4, 3) / 9 top-p stops at 4/9 + 3/9 >= 0.75.
    expected = torch.tensor([0.0, 0.0, 4 / 7, 3 / 7], dtype=torch.float64)
    # Top-p first would stop at 0.4 + 0.3 + 0.2 >= 0.75, and min-p then keeps all three.
    top_p_first = torch.tensor([2 / 9, 0.0, 4 / 9, 3 / 9], dtype=torch.float64)
    torch.testing.assert_close(ref_distribution(logits, row), expected)
    torch.testing.assert_close(filtered_probs(logits[None], [row.params])[0].double(), expected)

    empirical = _empirical(logits, row, draws=20_000)
    assert (empirical > 0).tolist() == [False, False, True, True]
    assert _tv(empirical, expected) < TV_TOLERANCE
    assert _tv(empirical, top_p_first) > 5 * TV_TOLERANCE


@pytest.mark.parametrize("temperature", [0.3, 4.0])
def test_temperature_reshapes_distribution(temperature):
    torch.manual_seed(4)
    logits = torch.randn(16) * 2
    row = _row(SamplingParams(temperature=temperature))
    empirical = _empirical(logits, row, draws=20_000)
    assert _tv(empirical, ref_distribution(logits, row)) < TV_TOLERANCE
    # A sampler that ignored temperature would match softmax(logits) instead.
    assert _tv(empirical, torch.softmax(logits.double(), dim=-1)) > 5 * TV_TOLERANCE


# --- seeds ------------------------------------------------------------------------------


def _request_logits(request: int, step: int, vocab: int = 1000) -> torch.Tensor:
    """Logits depending only on (request, step), whatever the batch looks like."""
    return torch.randn(vocab, generator=torch.Generator().manual_seed(1000 * request + step))


SEEDED = {  # request id -> params
    0: SamplingParams(temperature=1.0, seed=11),
    1: SamplingParams(temperature=0.8, top_k=50, seed=12),
    2: SamplingParams(temperature=1.1, top_p=0.9, min_p=0.01, seed=13, frequency_penalty=0.5),
    3: SamplingParams(temperature=1.0, seed=11),  # same seed as request 0
}


def _run_batch(params: dict[int, SamplingParams], order: list[int], steps: int = 6) -> dict[int, list[int]]:
    """Decode `steps` tokens for requests in batch order `order`; returns outputs by id."""
    rows = {r: _row(p, prompt=[1, 2, 3], generator=make_generator(p.seed, "cpu")) for r, p in params.items()}
    for step in range(steps):
        logits = torch.stack([_request_logits(r, step) for r in order])
        out = sample(logits, [rows[r] for r in order])
        for r, token in zip(order, out.token_ids):
            rows[r].output_token_ids.append(token)
    return {r: rows[r].output_token_ids for r in params}


def test_seeded_rows_reproducible_across_batch_layouts():
    torch.manual_seed(5)
    alone = {r: _run_batch({r: p}, [r])[r] for r, p in SEEDED.items()}

    extra = {
        10: SamplingParams(temperature=1.0),  # unseeded
        11: SamplingParams(temperature=0.0),  # greedy
        12: SamplingParams(temperature=0.5, seed=99, logprobs=3),
    }
    mixed = {**SEEDED, **extra}
    order = list(mixed)
    random.Random(0).shuffle(order)
    together = _run_batch(mixed, order)

    for r in SEEDED:
        assert together[r] == alone[r], r
    # Sanity: seeds matter (same seed, different logits gives different tokens).
    assert alone[0] != alone[3] and alone[0] != alone[1]


def test_make_generator():
    assert make_generator(None, "cpu") is None
    a, b = make_generator(7, "cpu"), make_generator(7, "cpu")
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


# --- logprobs ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_for_sampled_and_top_n(dtype):
    torch.manual_seed(6)
    params = [
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=2.0),
        SamplingParams(temperature=1.5, logprobs=5, top_k=20, presence_penalty=1.0),
        SamplingParams(temperature=0.7, logprobs=None),
        SamplingParams(temperature=1.0, logprobs=20, top_p=0.5),
    ]
    rows = [_row(p, prompt=[4, 5], output=[6, 6, 7]) for p in params]
    logits = (torch.randn(len(rows), 300) * 2).to(dtype)
    raw = torch.log_softmax(logits.float(), dim=-1)

    out = sample(logits, rows)

    for i, p in enumerate(params):
        got, token = out.logprobs[i], out.token_ids[i]
        if p.logprobs is None:
            assert got is None
            continue
        top = raw[i].topk(p.logprobs).indices.tolist()
        assert set(got) == {token, *top}
        for t, value in got.items():
            assert value == pytest.approx(raw[i, t].item(), abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_argmax_ties_nan_and_inf_included(dtype):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    rows, vocab = random.randint(1, 40), random.randint(1, 40_000)
    x = torch.randint(-3, 3, (rows, vocab), generator=gen).to(dtype)  # many exact ties
    x[0, torch.randint(0, vocab, (3,), generator=gen)] = float("nan")
    x[-1] = float("-inf")
    assert torch.equal(greedy_tokens(x), x.argmax(dim=-1))


# --- the native random sampler against the torch form ------------------------------------


def _random_filters(gen: torch.Generator, rows: int) -> list[SamplingParams]:
    """Each filter on in about half the rows, at random strengths."""
    def coin() -> bool:
        return bool(torch.rand(1, generator=gen) < 0.5)

    def uniform(low: float, high: float) -> float:
        return low + (high - low) * float(torch.rand(1, generator=gen))

    return [SamplingParams(temperature=uniform(0.2, 2.0), top_k=int(torch.randint(1, 300, (1,), generator=gen)) if coin() else 0,
                           top_p=uniform(0.05, 1.0) if coin() else 1.0, min_p=uniform(0.0, 0.3) if coin() else 0.0)
            for _ in range(rows)]  # fmt: skip


@pytest.mark.parametrize("vocab", [8192, 1000, 37, 2])
def test_native_sampling_draws_the_torch_forms_token_from_each_uniform(vocab):
    """Fresh random rows (logits at random scales, some masked to -inf) and filters: the
    native sampler takes the token the torch form (`filtered_probs` then `inverse_cdf`) takes
    for the same uniform number. They round e^x in their last bits differently, so a draw
    that falls within rounding of a cut may differ: at most 2 in 2,000."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    rows, batches, differ = 250, 8, 0
    for _ in range(batches):
        x = torch.randn(rows, vocab, generator=gen) * (0.2 + 4 * torch.rand(rows, 1, generator=gen))
        x[torch.rand(rows, vocab, generator=gen) < 0.3 * torch.rand(rows, 1, generator=gen)] = float("-inf")
        x[torch.arange(rows), torch.randint(vocab, (rows,), generator=gen)] = 0.5  # a finite logit in every row
        params = _random_filters(gen, rows)
        u = torch.rand(rows, dtype=torch.float64, generator=gen)
        u[:4] = torch.tensor([0.0, 1.0 - 2**-53, 0.5, 1e-300], dtype=torch.float64)
        expected = inverse_cdf(filtered_probs(x.clone(), params), u)
        got = sample_native(x.clone(), params, u)
        assert (x.gather(1, got.unsqueeze(1)) > float("-inf")).all()  # never a masked token
        differ += int((got != expected).sum())
    assert differ <= 2, f"{differ} of {rows * batches} draws differ (seed {seed})"


def test_native_filters_keep_the_torch_forms_probabilities():
    """What speculative verification reads (`filter_native`): per row the weights the native
    sampler draws from, and their total; weight / total is the torch form's probability
    (`filtered_probs`) on fresh random rows and filters, and the same tokens are kept (a weight
    below 1e-30 counts as dropped: the kernel floors e^x at e^-87 where torch gives 0), but
    where top-k keeps tokens tied with the k-th (the kernel keeps them, as vLLM; the torch form
    keeps k) or e^x's last bits move a weight across a cut: at most 2 rows in 1,000. A row the
    kernel refuses gets -1 and is left as it was; `filtered_weights` gives it the torch form's
    probabilities (total 1) and the other rows the kernel's weights."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = 1000, 1000
    x = torch.randn(rows, vocab, generator=gen) * (0.2 + 4 * torch.rand(rows, 1, generator=gen))
    x[torch.rand(rows, vocab, generator=gen) < 0.3 * torch.rand(rows, 1, generator=gen)] = float("-inf")
    x[torch.arange(rows), torch.randint(vocab, (rows,), generator=gen)] = 0.5
    x[7, 3] = float("nan")
    params = _random_filters(gen, rows)
    expected = filtered_probs(x.clone(), params)
    weights = x.clone()
    totals = filter_native(weights, params)
    assert totals[7] == -1 and torch.equal(weights[7].isnan(), x[7].isnan())
    kept = [r for r in range(rows) if r != 7]
    probs = weights[kept].double() / totals[kept, None]
    same_cut = ((probs > 1e-30) == (expected[kept] > 1e-30)).all(dim=1)
    assert int((~same_cut).sum()) <= 2, f"seed {seed}"
    torch.testing.assert_close(probs[same_cut], expected[kept][same_cut].double(), rtol=1e-5, atol=1e-7, msg=f"seed {seed}")
    mixed, mixed_totals = filtered_weights(x[5:9].clone(), params[5:9])  # row 7 (the NaN) goes to the torch form
    assert mixed_totals.tolist() == [float(t) for t in totals[5:7]] + [1.0, float(totals[8])]
    assert torch.equal(mixed[[0, 1, 3]], weights[[5, 6, 8]])
    assert torch.equal(mixed[2].isnan(), expected[7].isnan()) and torch.equal(mixed[2].nan_to_num(), expected[7].nan_to_num())


def test_native_top_k_keeps_the_tokens_tied_with_the_kth():
    """As vLLM's top-k: every token at least the k-th largest logit stays (here 4 for k = 2)."""
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0]])
    params = [SamplingParams(temperature=1.0, top_k=2)]
    seen = {int(sample_native(x.clone(), params, torch.tensor([u], dtype=torch.float64))) for u in torch.linspace(0, 0.999, 200).tolist()}
    assert seen == {1, 3}
    params = [SamplingParams(temperature=1.0, top_k=3)]
    seen = {int(sample_native(x.clone(), params, torch.tensor([u], dtype=torch.float64))) for u in torch.linspace(0, 0.999, 200).tolist()}
    assert seen == {1, 2, 3, 4, 5}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_row_the_native_sampler_cannot_take_is_left_whole_for_the_torch_form(bad):
    """A row holding NaN or +inf, or only -inf, gets -1 and is untouched; `sample` takes it
    with the torch form and the other rows natively, each from its own seeded generator."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 300, generator=gen)
    x[1, 7] = bad
    x[2] = float("-inf")
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s) for s in range(4)]
    before = x.clone()
    out = sample_native(x, params, torch.full((4,), 0.5, dtype=torch.float64))
    assert out[1] == -1 and out[2] == -1 and out[0] >= 0 and out[3] >= 0
    torch.testing.assert_close(x[1:3], before[1:3], rtol=0, atol=0, equal_nan=True)

    rows = [_row(p, generator=make_generator(p.seed, "cpu")) for p in params]
    u = uniforms([make_generator(p.seed, "cpu") for p in params], torch.device("cpu"))
    expected = inverse_cdf(filtered_probs(before.clone(), params), u)
    assert sample(before, rows).token_ids == expected.tolist()


def test_native_sampling_edge_rows_match_the_torch_form():
    """Rows picked to break a sampler: a draw at the very end of the mass behind a block of
    masked tokens (it once ran a block twice and took a masked token), a temperature past
    float32 with top-k (top-k must rank the logits, not weights that round equal), and tied
    most likely tokens under a small top-p (as many kept as the torch form keeps)."""
    masked_tail = torch.full((1, 512), float("-inf"))
    masked_tail[0, 0], masked_tail[0, 1:256] = 0.0, -40.06
    plain = [SamplingParams(temperature=1.0)]
    for k in range(1, 64):
        u = torch.tensor([1.0 - k * 2.0**-53], dtype=torch.float64)
        assert int(sample_native(masked_tail.clone(), plain, u)) == int(inverse_cdf(filtered_probs(masked_tail.clone(), plain), u))

    gen = torch.Generator().manual_seed(11)
    wide = torch.randn(4, 1000, generator=gen)
    wide[:, ::3] = float("-inf")
    hot = [SamplingParams(temperature=1e39, top_k=5)] * 4
    for u in torch.rand(8, 4, dtype=torch.float64, generator=gen):
        assert torch.equal(sample_native(wide.clone(), hot, u), inverse_cdf(filtered_probs(wide.clone(), hot), u))

    for tied, top_p in ((torch.zeros(1, 8), 0.5), (torch.tensor([[2.0, 2.0, 0.0, 0.0]]), 0.3)):
        params = [SamplingParams(temperature=1.0, top_p=top_p)]
        weights = tied.clone()
        sample_native(weights, params, torch.tensor([0.5], dtype=torch.float64))
        assert int((weights > 0).sum()) == int((filtered_probs(tied.clone(), params) > 0).sum())


def test_native_penalties_equal_the_torch_form_bit_for_bit():
    """Fresh random rows, a tenth masked, prompts and outputs of random lengths (repeats
    included) and penalties across their range, rounding edges too (a repetition penalty that
    float32 takes as 0 or as a denormal): the native penalties give the torch form's values."""
    seed = random.randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    differ = 0
    for vocab in (8192, 100, 7):
        rows_n = 8
        x = torch.randn(rows_n, vocab, generator=gen) * 5
        x[torch.rand(rows_n, vocab, generator=gen) < 0.1] = float("-inf")
        x[torch.rand(rows_n, vocab, generator=gen) < 0.05] = 0.0  # (equal as values whatever their sign)
        x[torch.rand(rows_n, vocab, generator=gen) < 0.05] = -0.0
        rows = [_row(SamplingParams(temperature=1.0, repetition_penalty=rng.choice([1.0, 1.1, 0.9, 3.0, 1e38, 5e-324, 1e-40]),
                                    frequency_penalty=rng.choice([0.0, 0.5, -0.3, 2.0, -2.0, 1e-40]),
                                    presence_penalty=rng.choice([0.0, 0.5, -0.3, 2.0, -2.0, 5e-324])),
                     prompt=[rng.randrange(vocab) for _ in range(rng.randrange(0, 50))],
                     output=[rng.randrange(vocab) for _ in range(rng.randrange(0, 300))])
                for _ in range(rows_n)]  # fmt: skip
        expected, got = penalties_torch(x.clone(), rows), apply_penalties(x.clone(), rows)
        differ += int((~((expected == got) | (expected.isnan() & got.isnan()))).sum())
    assert differ == 0, f"{differ} logits differ (seed {seed})"


def test_native_penalties_refuse_a_token_outside_the_vocabulary():
    rows = [_row(SamplingParams(temperature=1.0, frequency_penalty=0.5), prompt=[1], output=[2, 50])]
    with pytest.raises(IndexError, match="outside the vocabulary of 50"):
        apply_penalties(torch.randn(1, 50), rows)
