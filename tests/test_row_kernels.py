"""`native/rows.c` (RMSNorm in bf16, the greedy argmax, row copies, the final norm over the
streams, the MTP layer's input norms and residual adds) against their torch forms, in every
build: the widest vector path this CPU has and plain C."""

import pytest
import torch

from oxserve.engine.sampler import greedy_tokens
from oxserve.kernels import native, rows
from oxserve.kernels.norm import mean_rms_norm, mtp_input_norms, rms_norm, rms_norm_torch

BUILDS = {"native": rows.BUILD_FLAGS, "plain": ("-O3", "-fopenmp", "-mno-avx2", "-mno-avx512f")}


@pytest.fixture(params=list(BUILDS))
def kernel(request, monkeypatch):
    lib = rows.bind(native.load("rows", BUILDS[request.param]))
    monkeypatch.setattr(rows, "_kernel", lambda: lib)
    return lib


@pytest.mark.parametrize("tokens,dim", [(1, 256), (33, 64), (9, 100), (512, 256)])
def test_rms_norm_rounds_as_the_reference(kernel, tokens, dim):
    """bf16 in and out, fp32 inside: the same value as the 8 eager ops, except where the
    order of the fp32 sum of squares moves a rounding (rarely, by an ulp before the scale)."""
    weight = (torch.randn(dim) * 0.5 + 1).bfloat16()
    for x in ((torch.randn(tokens, dim) * 3).bfloat16(), torch.randn(tokens, 2 * dim).bfloat16()[:, ::2]):  # strided: copied
        assert rows.rms_norm_fit(x, weight)
        got, want = rms_norm(x, weight, 1e-6), rms_norm_torch(x, weight, 1e-6)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        differ = got != want
        assert differ.float().mean() <= 0.01
        torch.testing.assert_close(got[differ].float(), want[differ].float(), rtol=2**-6, atol=0)


def test_rms_norm_keeps_the_torch_form_where_the_kernel_does_not_fit():
    x, weight = torch.randn(3, 64), torch.randn(64)
    assert not rows.rms_norm_fit(x, weight) and torch.equal(rms_norm(x, weight, 1e-5), rms_norm_torch(x, weight, 1e-5))


@pytest.mark.parametrize("batch,vocab", [(1, 8192), (32, 8192), (5, 37), (3, 1)])
def test_greedy_picks_what_argmax_picks(kernel, batch, vocab):
    logits = torch.randn(batch, vocab)
    logits[0, vocab // 2 :] = logits[0].max()  # a tie: the first index wins
    if batch > 2:
        logits[1, :] = float("-inf")  # all -inf: index 0
        logits[2, vocab // 3] = float("nan")  # a NaN is the largest
        if vocab > 20:
            logits[2, vocab - 2] = float("nan")
    if batch > 3 and vocab > 20:  # a tie of -0 and +0, which compare equal: the first wins
        logits[3] = -1.0 - torch.rand(vocab)
        logits[3, 9], logits[3, 17] = -0.0, 0.0
    assert rows.argmax_fit(logits)
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    wide = torch.randn(batch, vocab + 5)[:, :vocab]  # rows further apart than their length
    assert torch.equal(greedy_tokens(wide), wide.argmax(-1))
    assert greedy_tokens(torch.empty(0, vocab)).shape == (0,)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
@pytest.mark.parametrize("n,repeat", [(1, 4), (7, 1), (0, 4)])
def test_row_gathers_and_scatters_copy_rows_as_torch(kernel, dtype, n, repeat):
    """Embedding lookups repeated per stream and cache stores, for any dtype; an index out of
    range is an error that writes nothing (torch's index checks)."""
    table = (torch.randn(50, 24) * 100).to(dtype)
    ids = torch.randint(0, 50, (n,))
    want = torch.nn.functional.embedding(ids, table.float()).to(dtype).unsqueeze(1).expand(-1, repeat, -1)
    assert rows.rows_fit(table) and torch.equal(rows.repeated_embedding(table, ids, repeat), want)
    targets, values = torch.randperm(50)[:n], (torch.randn(n, 24) * 100).to(dtype)
    got, expected = table.clone(), table.clone().index_copy_(0, targets, values)
    assert rows.rows_fit(got, values)
    rows.scatter_rows_native(got, targets, values)
    assert torch.equal(got, expected)
    before = got.clone()
    for bad in (torch.tensor([3, 50]), torch.tensor([-1, 2])):
        with pytest.raises(IndexError):
            rows.scatter_rows_native(got, bad, table[:2].clone())
        with pytest.raises(IndexError):
            rows.repeated_embedding(table, bad, repeat)
    assert torch.equal(got, before)
    assert not rows.rows_fit(table, values.to(torch.float16)) and not rows.rows_fit(table.t())


@pytest.mark.parametrize("tokens,streams,dim,wanted", [(1, 4, 256, [0]), (33, 4, 64, [32, 0, 5]), (6, 3, 100, [5, 5])])
def test_final_norm_over_streams_rounds_as_the_reference(kernel, tokens, streams, dim, wanted):
    """The stream mean rounded to bf16, then RMSNorm: the eager ops' value, but where the fp32
    sums' order moves a rounding (by an ulp)."""
    x = (torch.randn(tokens, streams, dim) * 3).bfloat16()
    weight = (torch.randn(dim) * 0.5 + 1).bfloat16()
    ids = torch.tensor(wanted)
    assert rows.mean_rms_norm_fit(x, weight)
    got, want = mean_rms_norm(x, ids, weight, 1e-6), rms_norm_torch(x[ids].mean(1), weight, 1e-6)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    differ = got != want
    assert differ.float().mean() <= 0.02
    torch.testing.assert_close(got[differ].float(), want[differ].float(), rtol=2**-6, atol=0)
    with pytest.raises(IndexError):
        mean_rms_norm(x, torch.tensor([tokens]), weight, 1e-6)
    assert not rows.mean_rms_norm_fit(x.float(), weight)


@pytest.mark.parametrize("tokens,dim", [(1, 256), (3, 64), (12, 100)])
def test_mtp_input_is_the_masked_embedding_and_the_hidden_state_normed_side_by_side(kernel, tokens, dim):
    """One pass for the MTP layer's masked_fill, two RMSNorms and cat: each half is the
    kernel's RMSNorm of its rows (bit for bit), an embedding at position 0 a zero row's; and
    the eager ops' value but where the fp32 sums' order moves a rounding (by an ulp)."""
    gen = torch.Generator().manual_seed(tokens * 1000 + dim)
    embeds, hidden = (torch.randn(tokens, dim, generator=gen) * 3).bfloat16(), torch.randn(tokens, dim, generator=gen).bfloat16()
    we = -(torch.rand(dim, generator=gen) + 0.5).bfloat16()  # negative: a zero row normed is -0
    wh = (torch.randn(dim, generator=gen) * 0.5 + 1).bfloat16()
    positions = torch.randint(0, 3, (tokens,), generator=gen)
    positions[0] = 0
    got = mtp_input_norms(embeds, positions, we, 1e-6, hidden, wh, 1e-5)
    masked = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)
    assert got.shape == (tokens, 2 * dim) and got.dtype == torch.bfloat16
    assert torch.equal(got, torch.cat([rms_norm(masked, we, 1e-6), rms_norm(hidden, wh, 1e-5)], -1))
    eager = torch.cat([rms_norm_torch(masked, we, 1e-6), rms_norm_torch(hidden, wh, 1e-5)], -1)
    differ = got != eager
    assert differ.float().mean() <= 0.01
    torch.testing.assert_close(got[differ].float(), eager[differ].float(), rtol=2**-6, atol=0)
    assert torch.equal(got[0, :dim].view(torch.int16), (we * 0.0).view(torch.int16))  # a zero row normed: signed zeros
    with pytest.raises(ValueError):
        rows.mtp_input_norms_native(embeds, positions[:-1], we, 1e-6, hidden, wh, 1e-5)
    with pytest.raises(ValueError):
        rows.mtp_input_norms_native(embeds, positions, we[:-1], 1e-6, hidden, wh, 1e-5)


@pytest.mark.parametrize("wanted", [None, [0], [4, 1, 4], []])
def test_residual_adds_of_the_rows_wanted_round_as_torch(kernel, wanted):
    """(a + b)[rows] in bf16 (the fp32 sum rounded to nearest even), bit for bit, infinities,
    NaN and sums past bf16's range included; a row past the end is an error, as torch's index,
    and so is a negative one (which torch's index would count from the end); other index forms
    (a mask, 2-D rows) take the torch form."""
    gen = torch.Generator().manual_seed(len(wanted or []) * 10 + (wanted or [0])[0])
    a, b = (torch.randn(6, 40, generator=gen) * 100).bfloat16(), (torch.randn(6, 40, generator=gen) * 100).bfloat16()
    a[1, :4] = torch.tensor([float("inf"), float("nan"), 3e38, -0.0]).bfloat16()
    b[1, :4] = torch.tensor([-float("inf"), 1.0, 3e38, -0.0]).bfloat16()
    rows_wanted = None if wanted is None else torch.tensor(wanted, dtype=torch.int64)
    assert rows.add_rows_fit(a, b, rows_wanted)
    got = rows.add_rows(a, b, rows_wanted)
    want = a + b if rows_wanted is None else (a + b)[rows_wanted]
    nan = want.isnan()
    assert got.shape == want.shape and torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])  # signed zeros, infinities
    for bad in ([6], [-1]):
        with pytest.raises(IndexError):
            rows.add_rows(a, b, torch.tensor(bad))
    mask = torch.tensor([True, False, True, False, False, True])
    assert not rows.add_rows_fit(a, b, mask) and torch.equal(rows.add_rows(a, b, mask), (a + b)[mask])
    assert not rows.add_rows_fit(a, b, torch.tensor([[0, 1]]))
    fa, fb = torch.randn(6, 40, generator=gen), torch.randn(6, 40, generator=gen)  # (fp32: the torch form)
    assert not rows.add_rows_fit(fa, fb) and torch.equal(rows.add_rows(fa, fb, torch.tensor([2, 2])), (fa + fb)[[2, 2]])
