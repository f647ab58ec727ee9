"""`native/rows.c` (RMSNorm in bf16, the greedy argmax) against their torch forms, in every
build: the widest vector path this CPU has and plain C."""

import pytest
import torch

from oxserve.engine.sampler import greedy_tokens
from oxserve.kernels import native, rows
from oxserve.kernels.norm import rms_norm, rms_norm_torch

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
    assert rows.argmax_fit(logits)
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    wide = torch.randn(batch, vocab + 5)[:, :vocab]  # rows further apart than their length
    assert torch.equal(greedy_tokens(wide), wide.argmax(-1))
    assert greedy_tokens(torch.empty(0, vocab)).shape == (0,)
