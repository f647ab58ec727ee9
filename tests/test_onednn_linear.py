"""oneDNN pre-packed linears: the same products as F.linear, the same model once loaded."""

import random

import pytest
import torch
import torch.nn.functional as F

from oxserve.kernels.moe import panel_builds, panel_isa, panel_linear
from oxserve.kernels.onednn import PanelLinear, OneDNNLinear, bucket_rows, choose_linear_kernel, use_onednn_linears
from oxserve.model.linear import Linear
from oxserve.model.loader import load_model
from hf_reference import build_reference, tiny_config


BF16_ONEDNN = torch.ops.mkldnn._is_mkldnn_bf16_supported()
PANELS = panel_isa() is not None


def in_input_order(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] times weight [..., N, K]^T as fp32 sums in input order, rounded once to bf16
    (a bf16 product is exact in fp32, so each add is one fused multiply-add)."""
    acc = torch.zeros(*x.shape[:-1], weight.shape[-2])
    for k in range(x.shape[-1]):
        acc = acc + x[..., k, None].float() * weight[..., k].float()
    return acc.bfloat16()


def assert_as_its_build(isa: str, got: torch.Tensor, torch_bf16: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """The AVX2 build sums in input order, which torch's bf16 products on an AVX2 CPU do only
    for small shapes: exact against that sum, one bf16 rounding from torch's. The tile and
    bf16-vector builds take the same exact products as oneDNN's bf16 (`torch_bf16`), but fp32
    sums in an order of their own: oneDNN's blocking depends on the shape and the CPU (on an
    AMX Xeon it differs from 65 rows up), so a rare output lands one bf16 step away."""
    if isa == "avx2":
        assert torch.equal(got, in_input_order(x, weight).to(got.dtype))
        torch.testing.assert_close(got, torch_bf16.to(got.dtype), rtol=1e-2, atol=1e-2)
    else:
        assert_one_bf16_step_at_most(got, torch_bf16.to(got.dtype))


def assert_one_bf16_step_at_most(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for rare outputs (1% and two more, for small outputs) one bf16 step apart
    (2^-7 of the value, with a floor for values that cancel to near zero)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    g, w = got.float(), want.float()
    assert int((g != w).sum()) <= 0.01 * g.numel() + 2
    assert ((g - w).abs() <= torch.maximum(g.abs(), w.abs()) * 2**-7 + 1e-3).all()


def test_auto_takes_panels_for_bf16_where_the_cpu_has_them_else_onednn_where_onednn_runs_it():
    cpu = torch.device("cpu")
    assert choose_linear_kernel("auto", cpu, torch.float32)[0] == "onednn"
    bf16 = "panels" if PANELS else "onednn" if BF16_ONEDNN else "torch"
    assert choose_linear_kernel("auto", cpu, torch.bfloat16)[0] == bf16
    if not PANELS:
        with pytest.raises(ValueError, match="AVX512-BF16"):
            choose_linear_kernel("panels", cpu, torch.bfloat16)
    assert choose_linear_kernel("auto", cpu, torch.float16) == ("torch", None)
    assert choose_linear_kernel("torch", cpu, torch.float32) == ("torch", None)
    with pytest.raises(ValueError, match="float32"):
        choose_linear_kernel("onednn", cpu, torch.float16)
    with pytest.raises(ValueError, match="AVX512-BF16"):
        choose_linear_kernel("panels", cpu, torch.float32)
    with pytest.raises(ValueError, match="auto, panels, onednn or torch"):
        choose_linear_kernel("mkl", cpu, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if BF16_ONEDNN else [torch.float32])
@pytest.mark.parametrize("rows", [0, 1, 2, 8, 33, 300])
def test_products_match_f_linear(rows, dtype):
    parts = (random.randint(1, 40), random.randint(1, 70))
    linear = Linear(random.randint(1, 90), parts)
    linear.weight.data = linear.weight.data.to(dtype)
    weight = torch.randn(sum(parts), linear.in_features, dtype=dtype)
    linear.weight.data.copy_(weight)
    packed = OneDNNLinear(linear)
    packed.after_load()
    assert packed.weight.numel() == 0  # the dense copy is freed
    torch.testing.assert_close(packed.dense_weight(), weight, rtol=0, atol=0)
    # fp32: another summation order; bf16: one output rounding apart at most (both sum in fp32)
    tol = dict(rtol=1e-5, atol=1e-5 * linear.in_features**0.5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for x in (torch.randn(rows, linear.in_features, dtype=dtype), torch.randn(2, rows, 2 * linear.in_features, dtype=dtype)[..., ::2]):
        out = packed(x)
        assert out.dtype == dtype
        torch.testing.assert_close(out, F.linear(x, weight), **tol)


@pytest.mark.parametrize("inputs", [32, 64, 96, 40])
@pytest.mark.parametrize("rows", [0, 1, 15, 16, 17, 65, 300])
def test_panel_products_equal_f_linear(rows, inputs):
    """bf16 on panels (AMX tiles, AVX512-BF16 or AVX2 vectors): any row count, outputs not a
    multiple of a panel pair; inputs that are not whole tiles (40) take oneDNN instead, or
    F.linear where oneDNN has no bf16. Without any panel build the kernel is refused above.
    Every build the CPU runs is checked."""
    if not PANELS and not BF16_ONEDNN:  # neither runs bf16 on this CPU (AVX2 only): nothing installs it
        with pytest.raises(ValueError, match="AVX512-BF16"):
            choose_linear_kernel("panels", torch.device("cpu"), torch.bfloat16)
        return
    parts = (random.randint(1, 40), random.randint(1, 70))
    linear = Linear(inputs, parts)
    weight = torch.randn(sum(parts), inputs).bfloat16()
    linear.weight.data = weight.clone()
    packed = PanelLinear(linear)
    packed.after_load()
    on_tiles = PANELS and inputs % 32 == 0
    # off the panels: oneDNN's packed copy replaces the weight, or F.linear keeps it where oneDNN has no bf16
    assert (packed.panels is not None) == on_tiles and (packed.weight.numel() == 0) == (on_tiles or BF16_ONEDNN)
    torch.testing.assert_close(packed.dense_weight(), weight, rtol=0, atol=0)
    for x in (torch.randn(rows, inputs).bfloat16(), torch.randn(2, rows, 2 * inputs).bfloat16()[..., ::2]):
        out = packed(x)
        assert out.dtype == torch.bfloat16 and out.shape == (*x.shape[:-1], sum(parts))
        wide = packed.forward_float(x)  # the LM head's logits: the same values, stored as fp32
        assert wide.dtype == torch.float32 and torch.equal(wide, out.float())
        if on_tiles:  # the same fp32 sums, rounded once
            assert_as_its_build(panel_isa(), out, F.linear(x, weight), x, weight)
            rows_in = x.reshape(-1, inputs)
            for isa, lib in panel_builds().items():
                want = F.linear(rows_in, weight)
                assert_as_its_build(isa, panel_linear(rows_in, packed.panels, sum(parts), lib=lib), want, rows_in, weight)
                assert_as_its_build(isa, panel_linear(rows_in, packed.panels, sum(parts), lib=lib, float_out=True),
                                    want, rows_in, weight)
        else:
            torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("tied", [True, False])
def test_loaded_model_keeps_what_it_shares(tmp_path, tied):
    top_level = {"tie_word_embeddings": tied}
    reference = build_reference("onednn", tmp_path, random.randrange(2**31), tiny_config(), top_level)
    plain = load_model(reference.path, dtype=torch.float32).model
    model = load_model(reference.path, dtype=torch.float32, transform=use_onednn_linears).model
    assert isinstance(model.lm_head, OneDNNLinear) and model.lm_head.shared_weight == tied
    # A tied head keeps the embedding's rows; every unshared projection gave up its dense copy.
    torch.testing.assert_close(model.embed_tokens, plain.embed_tokens, rtol=0, atol=0)
    assert model.layers[0].self_attn.o_proj.weight.numel() == 0
    hidden = torch.randn(3, model.config.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), plain.compute_logits(hidden), rtol=1e-5, atol=1e-4)


def test_row_buckets_are_few_and_waste_at_most_a_quarter():
    buckets = {bucket_rows(m) for m in range(1, 8193)}
    assert len(buckets) == 41 and max(buckets) == 8192
    for m in range(1, 8193):
        b = bucket_rows(m)
        assert b >= m and bucket_rows(b) == b, m
        assert b <= 16 or b < 1.25 * m, (m, b)


def test_products_are_the_same_at_any_row_count_of_a_bucket():
    """A padded row is computed as it would be alone in its bucket: rows 1..20 of a 20-row
    bucket agree bit for bit whatever the row count that carried them."""
    linear = Linear(64, (48,))
    linear.weight.data = torch.randn(48, 64)  # Linear starts uninitialised: garbage may hold NaNs
    packed = OneDNNLinear(linear)
    packed.after_load()
    x = torch.randn(20, 64)
    full = packed(x)
    for m in (17, 18, 19):
        torch.testing.assert_close(packed(x[:m]), full[:m], rtol=0, atol=0)


@pytest.mark.parametrize("rows,heads,inputs,outputs", [(1, 4, 64, 64), (33, 3, 32, 40), (70, 2, 96, 64), (0, 4, 64, 32)])
def test_per_head_panel_products_equal_the_einsum(rows, heads, inputs, outputs):
    """Absorbed MLA's per-head products (`panel_heads`): each head's rows times its own
    weight, the same fp32 sums rounded once as the batched GEMM, on every build."""
    from oxserve.kernels.moe import pack_heads, panel_heads

    x = torch.randn(rows, heads, 2 * inputs).bfloat16()[..., ::2]  # strided rows: copied, not misread
    weight = torch.randn(heads, outputs, inputs).bfloat16()
    want = torch.einsum("mhk,hnk->mhn", x, weight)
    if not PANELS:  # refused clearly where neither instruction set is
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            panel_heads(x, pack_heads(weight), outputs)
    for isa, lib in panel_builds().items():
        got = panel_heads(x, pack_heads(weight), outputs, lib=lib)
        assert got.shape == want.shape
        assert_as_its_build(isa, got, want, x, weight)
