"""The native C kernels against their torch versions and the float64 definition."""

import pytest
import torch

from oxserve.kernels import native
from oxserve.kernels.hyper import (NATIVE_MAX_N, hc_collapse_native, hc_collapse_torch, hc_expand_native, hc_expand_torch,
                                   hc_gates, hc_gates_native, hc_gates_torch)
from oxserve.kernels.token_mask import apply_token_bitmask_native, apply_token_bitmask_torch


def test_the_native_kernels_build_here():
    # The engine's CPU fast path depends on them: a machine without a C compiler is a set-up
    # failure (`make install` provides one), not a reason to skip.
    assert native.compiler() is not None
    assert native.load("hc_gates") is not None


def _definition(mixed, base, scale, n, iters, eps):
    """Per token, in float64, as the mHC paper states it."""
    x = mixed.double()
    base, scale = base.double(), scale.double()
    pre = torch.sigmoid(x[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(x[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb = torch.softmax(x[:, 2 * n :].view(-1, n, n) * scale[2] + base[2 * n :].view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(1, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(2, keepdim=True) + eps)
        comb = comb / (comb.sum(1, keepdim=True) + eps)
    return pre, post, comb


@pytest.mark.parametrize("n", [1, 2, 4, 7, NATIVE_MAX_N])
@pytest.mark.parametrize("tokens", [0, 1, 7, 8, 9, 300])
def test_hc_gates_native_matches_torch_and_definition(n, tokens):
    gen = torch.Generator().manual_seed(n * 1000 + tokens)
    width = (2 + n) * n
    mixed = torch.randn(tokens, width, generator=gen) * 4
    base = torch.randn(width, generator=gen)
    scale = torch.rand(3, generator=gen) + 0.5
    iters, eps = int(torch.randint(0, 21, (), generator=gen)), float(10 ** -torch.randint(3, 8, ()).item())
    got = hc_gates_native(mixed, base, scale, n, iters, eps)
    eager = hc_gates_torch(mixed, base, scale, n, iters, eps)
    exact = _definition(mixed, base, scale, n, iters, eps)
    for g, e, x in zip(got, eager, exact, strict=True):
        assert g.shape == e.shape and g.dtype == torch.float32
        torch.testing.assert_close(g, e, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(g.double(), x, rtol=1e-5, atol=1e-5)
    if tokens and iters >= 20 and eps < 1e-5:
        comb = got[2].double()  # converged: rows and columns sum to 1
        torch.testing.assert_close(comb.sum(1), torch.ones(tokens, n, dtype=torch.float64), rtol=0, atol=1e-3)


def test_hc_gates_takes_strided_inputs_and_large_n_falls_back():
    mixed = torch.randn(5, 2 * 24)[:, ::2]  # not contiguous
    base, scale = torch.randn(24), torch.rand(3) + 0.5
    for g, e in zip(hc_gates(mixed, base, scale, 4, 20, 1e-6), hc_gates_torch(mixed, base, scale, 4, 20, 1e-6)):
        torch.testing.assert_close(g, e, rtol=2e-6, atol=2e-6)
    n = NATIVE_MAX_N + 1
    width = (2 + n) * n
    args = torch.randn(3, width), torch.randn(width), torch.rand(3) + 0.5
    with pytest.raises(ValueError, match="limit"):
        hc_gates_native(*args, n, 5, 1e-6)
    for g, e in zip(hc_gates(*args, n, 5, 1e-6), hc_gates_torch(*args, n, 5, 1e-6)):
        torch.testing.assert_close(g, e)


def _close_in(dtype):
    """fp32: another summation order; bf16: also a rare one-ulp flip where a sum lands between
    two bf16 values."""
    return dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,n,d", [(0, 4, 64), (1, 4, 512), (7, 4, 33), (64, 1, 100), (5, 5, 80), (3, NATIVE_MAX_N, 20),
                                        (301, 4, 64)])
def test_hc_collapse_and_expand_native_match_torch(dtype, tokens, n, d):
    gen = torch.Generator().manual_seed(tokens * 100 + n * 10 + d)
    width = (2 + n) * n
    streams = (torch.randn(tokens, n, d, generator=gen) * 3).to(dtype)
    fn = (torch.randn(width, n * d, generator=gen) * (n * d) ** -0.5).to(dtype)
    base, scale = torch.randn(width, generator=gen), torch.rand(3, generator=gen) + 0.5
    block_norm = ((torch.rand(d, generator=gen) + 0.5).to(dtype), 1e-5)  # the block's RMSNorm, fused
    for norm in (None, block_norm):
        got = hc_collapse_native(streams, fn, base, scale, 20, 1e-6, 1e-5, norm)
        eager = hc_collapse_torch(streams, fn, base, scale, 20, 1e-6, 1e-5, norm)
        for g, e in zip(got, eager, strict=True):
            assert g.shape == e.shape and g.dtype == e.dtype
            torch.testing.assert_close(g.float(), e.float(), **(_close_in(dtype) if g.dtype == dtype else dict(rtol=2e-5, atol=2e-5)))
    eager = hc_collapse_torch(streams, fn, base, scale, 20, 1e-6, 1e-5)
    post, comb, block = eager
    new = hc_expand_native(post, comb, block, streams)
    expected = hc_expand_torch(post, comb, block, streams)
    assert new.shape == expected.shape and new.dtype == dtype
    torch.testing.assert_close(new.float(), expected.float(), **_close_in(dtype))
    if tokens and dtype == torch.bfloat16:  # the roundings are the torch version's: flips are rare
        assert (new != expected).float().mean() < 0.01


@pytest.mark.parametrize("n,d", [(4, 64 + 5), (3, 48), (4, 16)])
def test_hc_expand_bf16_rounds_as_torch_does_at_subnormals_infinities_and_nans(n, d):
    """In bf16 the expand rounds each term and their sum where torch's bf16 ops do; the
    hardware conversion (AVX512-BF16) reads subnormals as zeros, so vectors holding them take
    the integer rounding: bit for bit against torch's conversions, one fp32 op at a time, with
    subnormal, zero, infinite and NaN inputs and products that underflow."""
    gen = torch.Generator().manual_seed(n * 1000 + d)
    tokens = 9
    streams, block = torch.randn(tokens, n, d, generator=gen), torch.randn(tokens, d, generator=gen)
    post, comb = torch.rand(tokens, n, generator=gen) * 2, torch.rand(tokens, n, n, generator=gen)
    specials = torch.tensor([1e-39, -3e-40, 0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-37, 6e-38])
    for values in (streams.view(-1), block.view(-1)):
        picks = torch.randint(0, values.numel(), (values.numel() // 6,), generator=gen)
        values[picks] = specials[torch.randint(0, len(specials), (len(picks),), generator=gen)]
    post[0], comb[1] = 1e-3, 1e-3  # times 1e-37: products below the smallest normal
    post[2], comb[2], streams[2], block[2] = 1e-3, 1e-3, 1e-37, -2e-37  # every term and sum subnormal
    streams, block = streams.to(torch.bfloat16), block.to(torch.bfloat16)
    got = hc_expand_native(post, comb, block, streams)

    bf16 = torch.bfloat16
    p, c, s, b = post.to(bf16).float(), comb.to(bf16).float(), streams.float(), block.float()
    want = torch.empty_like(streams)
    for i in range(n):
        mixed = torch.zeros_like(b)
        for j in range(n):
            mixed = mixed + c[:, j, i, None] * s[:, j]
        want[:, i] = ((p[:, i, None] * b).to(bf16).float() + mixed.to(bf16).float()).to(bf16)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    subnormal = (want.float().abs() < 1.1754944e-38) & (want != 0)
    assert subnormal.sum() > 0  # the case the hardware conversion cannot take


def test_hc_collapse_native_gives_a_token_the_same_result_in_any_batch():
    """Tokens are taken in blocks: a token's gates and block input must not depend on which
    other tokens share its call (or a request's output would depend on the batch)."""
    gen = torch.Generator().manual_seed(7)
    n, d = 4, 96
    streams = torch.randn(37, n, d, generator=gen).bfloat16()
    fn = torch.randn((2 + n) * n, n * d, generator=gen) * (n * d) ** -0.5
    base, scale = torch.randn((2 + n) * n, generator=gen), torch.rand(3, generator=gen) + 0.5
    whole = hc_collapse_native(streams, fn, base, scale, 20, 1e-6, 1e-5)
    for start, stop in ((0, 1), (3, 6), (5, 37), (11, 20)):
        part = hc_collapse_native(streams[start:stop], fn, base, scale, 20, 1e-6, 1e-5)
        for p, w in zip(part, whole, strict=True):
            assert torch.equal(p, w[start:stop])


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000])
def test_token_mask_native_matches_torch_and_the_bits(vocab):
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    rows = [3, 0, 5]
    bits = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=gen, dtype=torch.int64).to(torch.int32)
    bits[0, 0], bits[1, -1] = 0, -1  # whole words disallowed and allowed
    wide = torch.randn(6, vocab + 7, generator=gen)
    logits = wide[:, :vocab]  # rows further apart than the vocabulary
    eager = logits.clone()
    apply_token_bitmask_native(logits, rows, bits)
    apply_token_bitmask_torch(eager, rows, bits)
    assert torch.equal(logits, eager)
    for k, row in enumerate(rows):
        allowed = [bool((int(bits[k, t // 32]) & 0xFFFFFFFF) >> (t % 32) & 1) for t in range(vocab)]
        assert [bool(x) for x in logits[row].isfinite()] == allowed
    untouched = [r for r in range(6) if r not in rows]
    assert torch.equal(logits[untouched], wide[untouched, :vocab]) and torch.isfinite(wide[:, vocab:]).all()


def test_token_mask_native_rejects_what_it_cannot_index():
    logits, bits = torch.zeros(2, 40), torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="outside"):
        apply_token_bitmask_native(logits, [2], bits)
    with pytest.raises(ValueError, match="does not fit"):
        apply_token_bitmask_native(logits, [0], torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="float32"):
        apply_token_bitmask_native(logits.double(), [0], bits)
