"""Grouped expert GEMMs and the native bf16 kernel against the per-expert loop."""

import pytest
import torch

from oxserve.kernels import moe, native
from oxserve.kernels.moe import grouped_experts, grouped_gemm_supported, looped_experts
from oxserve.model.config import TextModelConfig
from oxserve.model.moe import Experts
from tiny_models import TINY_TEXT_CONFIG


def make_config(**overrides) -> TextModelConfig:
    return TextModelConfig.from_hf_dict({**TINY_TEXT_CONFIG, **overrides})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pairs", [1, 7, 300])
def test_grouped_equals_loop(dtype, pairs):
    experts, hidden, inter = 6, 32, 16
    counts = torch.randint(0, 4, (experts,)).float()
    counts[2] = 0  # an expert with no rows
    counts = (counts / counts.sum().clamp(min=1) * pairs).floor().long()
    counts[-1] += pairs - counts.sum()
    offsets = counts.cumsum(0).to(torch.int32)
    rows = torch.randn(pairs, hidden).to(dtype)
    weight = torch.rand(pairs, 1)
    gate_up = (torch.randn(experts, 2 * inter, hidden) * 0.2).to(dtype)
    down = (torch.randn(experts, hidden, inter) * 0.2).to(dtype)
    got = grouped_experts(rows, weight, offsets, gate_up, down, 10.0)
    ref = looped_experts(rows, weight, offsets, gate_up, down, 10.0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    # The plain definition for one row of the first non-empty expert.
    e = int((counts > 0).nonzero()[0])
    r = int(offsets[e - 1]) if e else 0
    g, u = (gate_up[e].float() @ rows[r].float()).chunk(2)
    act = torch.nn.functional.silu(g.clamp(max=10)) * u.clamp(-10, 10) * weight[r]
    torch.testing.assert_close(got[r].float(), down[e].float() @ act.to(dtype).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,inter,grouped", [(torch.float32, 32, True), (torch.float32, 30, False), (torch.bfloat16, 36, False)])
def test_unaligned_expert_sizes_take_the_loop(dtype, inter, grouped):
    """The grouped GEMM needs 16-byte aligned rows; other sizes must still run (looped). 30
    tokens: more rows per expert than the native bf16 kernel takes."""
    assert grouped_gemm_supported(torch.device("cpu"), dtype, 64, inter) is grouped
    experts = Experts(make_config(n_routed_experts=4, moe_intermediate_size=inter, hidden_size=64))
    for p in experts.parameters():
        p.data = torch.randn_like(p, dtype=dtype) * 0.1
    x = torch.randn(30, 64, dtype=dtype)
    weights, ids = torch.rand(30, 2), torch.rand(30, 4).argsort(1)[:, :2]
    out = experts(x, weights, ids)
    ref = torch.zeros(30, 64)
    for t in range(30):
        for w, e in zip(weights[t], ids[t]):
            g, u = (experts.gate_up_proj[e].float() @ x[t].float()).chunk(2)
            ref[t] += experts.down_proj[e].float() @ (torch.nn.functional.silu(g.clamp(max=10)) * u.clamp(-10, 10) * w)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


# ---- the native bf16 kernel for decode-sized batches ---------------------------------------

NATIVE_BUILDS = {  # the widest vector path this CPU has, AVX2 without AVX-512, plain C
    "native": moe.BUILD_FLAGS,
    "avx2": ("-O3", "-fopenmp", "-mavx2", "-mfma", "-mno-avx512f"),
    "plain": ("-O3", "-fopenmp", "-mno-avx2", "-mno-avx512f"),
}


@pytest.mark.parametrize("build", NATIVE_BUILDS)
@pytest.mark.parametrize("hidden,inter,pairs", [(64, 32, 1), (96, 48, 13), (40, 20, 30), (512, 256, 64), (33, 7, 0)])
def test_native_experts_equal_the_loop(build, hidden, inter, pairs):
    """Every build against the per-expert loop, with widths that leave vector tails."""
    lib = moe.bind(native.load("moe_bf16", NATIVE_BUILDS[build]))
    rows, weight, offsets, gate_up, down = routed_case(hidden, inter, pairs)
    assert_like_the_loop(moe.native_experts(rows, weight, offsets, gate_up, down, 2.0, lib=lib), rows, weight, offsets, gate_up, down)


def routed_case(hidden: int, inter: int, pairs: int, experts: int = 5):
    """bf16 rows sorted over 5 experts (expert 1 gets none), and weights with some gates past a
    clamp of 2."""
    ids = torch.randint(0, experts - 1, (pairs,))
    ids[ids >= 1] += 1
    offsets = ids.bincount(minlength=experts).cumsum(0).to(torch.int32)
    rows = torch.randn(pairs, hidden).bfloat16()
    weight = torch.rand(pairs, 1) + 0.1
    gate_up = (torch.randn(experts, 2 * inter, hidden) * 3 / hidden**0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter) / inter**0.5).bfloat16()
    return rows, weight, offsets, gate_up, down


def assert_like_the_loop(got, rows, weight, offsets, gate_up, down):
    """Against the per-expert loop, which rounds where the kernels do: summation order (and
    the panel kernel's vector exp) differ, so a rare one-ulp flip of an intermediate, no more."""
    ref = looped_experts(rows, weight, offsets, gate_up, down, 2.0)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    if rows.shape[0]:
        assert (got.float() - ref.float()).norm() <= 5e-3 * ref.float().norm()
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_native_experts_keep_a_nan():
    rows = torch.randn(2, 32).bfloat16()
    rows[1, 3] = float("nan")
    gate_up, down = torch.randn(1, 16, 32).bfloat16(), torch.randn(1, 32, 8).bfloat16()
    out = moe.native_experts(rows, torch.ones(2, 1), torch.tensor([2], dtype=torch.int32), gate_up, down, 10.0)
    assert out[0].isfinite().all() and out[1].isnan().all()


def test_experts_take_the_native_kernel_for_few_rows_per_expert(monkeypatch):
    calls = []
    monkeypatch.setattr("oxserve.model.moe.native_experts", lambda *a: calls.append(a[0].shape[0]) or moe.native_experts(*a))
    layer = Experts(make_config(n_routed_experts=4, moe_intermediate_size=32, hidden_size=64))
    for p in layer.parameters():
        p.data = (torch.randn_like(p, dtype=torch.float32) * 0.1).bfloat16()
    few, many = torch.randn(3, 64).bfloat16(), torch.randn(40, 64).bfloat16()  # 6 and 80 pairs for 4 experts
    for x in (few, many, few.float()):
        layer.gate_up_proj.data, layer.down_proj.data = layer.gate_up_proj.to(x.dtype), layer.down_proj.to(x.dtype)
        layer(x, torch.rand(x.shape[0], 2), torch.rand(x.shape[0], 4).argsort(1)[:, :2])
    assert calls == [6]  # bf16 with few rows per expert; not 80 pairs, not fp32


# ---- the panel kernel (AMX, AVX512-BF16 or AVX2), on weights packed at load --------------------

PANELS = moe.panel_experts_fit(torch.device("cpu"), torch.bfloat16, 64, 32)


def test_panels_hold_the_same_values():
    weight = torch.randn(3, 48, 64).bfloat16()
    packed = moe.pack_panels(weight)
    assert packed.shape == (3, 3, 32, 16, 2) and packed[1, 2, 5, 7, 1] == weight[1, 2 * 16 + 7, 2 * 5 + 1]
    assert torch.equal(moe.unpack_panels(packed), weight)


def test_panels_are_taken_where_the_cpu_has_amx_avx512_bf16_or_avx2():
    flags = open("/proc/cpuinfo").read().split()
    assert moe.panel_isa() == ("amx" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags
                               else "avx2" if "avx2" in flags and "fma" in flags else None)
    assert PANELS == (moe.panel_isa() is not None)  # this machine: a compiler, and Linux grants AMX tiles
    cpu = torch.device("cpu")
    assert not moe.panel_experts_fit(cpu, torch.float32, 64, 32) and not moe.panel_experts_fit(cpu, torch.bfloat16, 64, 48)
    layer = Experts(make_config(n_routed_experts=4, moe_intermediate_size=32, hidden_size=64))
    for p in layer.parameters():
        p.data = (torch.randn_like(p, dtype=torch.float32) * 0.1).bfloat16()
    layer.after_load()
    assert layer.packed == PANELS and (layer.gate_up_proj.numel() == 0) == PANELS


@pytest.mark.parametrize("hidden,inter,pairs", [(64, 32, 1), (96, 64, 13), (512, 256, 64), (64, 32, 300), (32, 32, 0)])
def test_panel_experts_equal_the_loop(hidden, inter, pairs):
    """More and fewer than a tile's 16 rows (and the vectors' 8 and 4) per expert, every build
    this CPU runs. The tile and bf16-vector builds take the same exact products, but each adds a
    pair of them in its own order (AMX's even input first, vdpbf16ps's odd), so a rare
    intermediate lands one bf16 step apart (seen from 96 inputs up on an AMX Xeon), and the
    down projection carries that into its row's outputs."""
    rows, weight, offsets, gate_up, down = routed_case(hidden, inter, pairs)
    if not PANELS:  # a CPU without AMX-BF16, AVX512-BF16 or AVX2 refuses, clearly
        with pytest.raises(RuntimeError, match="AVX2"):
            moe.panel_experts(rows, weight, offsets, moe.pack_panels(gate_up), moe.pack_panels(down), 2.0)
        return
    outputs = {isa: moe.panel_experts(rows, weight, offsets, moe.pack_panels(gate_up), moe.pack_panels(down), 2.0, lib=lib)
               for isa, lib in moe.panel_builds().items()}
    assert tuple(outputs) == moe.PANEL_BUILDS[moe.panel_isa()]
    for isa, got in outputs.items():
        assert_like_the_loop(got, rows, weight, offsets, gate_up, down)
        if isa != "avx2":
            first = next(iter(outputs.values())).float()  # a flipped intermediate moves its row's outputs a little
            assert (got.float() - first).norm() <= 2**-7 * first.norm()


def test_panel_experts_keep_a_nan_and_a_loaded_layer_computes_what_the_dense_one_did():
    if PANELS:
        rows = torch.randn(2, 32).bfloat16()
        rows[1, 3] = float("nan")
        gate_up, down = moe.pack_panels(torch.randn(1, 64, 32).bfloat16()), moe.pack_panels(torch.randn(1, 32, 32).bfloat16())
        out = moe.panel_experts(rows, torch.ones(2, 1), torch.tensor([2], dtype=torch.int32), gate_up, down, 10.0)
        assert out[0].isfinite().all() and out[1].isnan().all()
    layer = Experts(make_config(n_routed_experts=4, moe_intermediate_size=32, hidden_size=64))
    for p in layer.parameters():
        p.data = (torch.randn_like(p, dtype=torch.float32) * 0.1).bfloat16()
    x, weights, ids = torch.randn(40, 64).bfloat16(), torch.rand(40, 2), torch.rand(40, 4).argsort(1)[:, :2]
    dense = layer(x, weights, ids)
    layer.after_load()
    torch.testing.assert_close(layer(x, weights, ids).float(), dense.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("linear_kernel", ["torch", "onednn", "auto"])
@pytest.mark.parametrize("hidden_act,tokens", [("silu", 1), ("silu", 37), ("gelu", 5)])
def test_a_loaded_dense_mlp_runs_as_one_panel_expert_where_it_can(linear_kernel, hidden_act, tokens):
    """Shared experts and dense MLPs: on panels a bf16 SiLU MLP moves into the experts kernel's
    panels and computes what its two products and the GLU did; elsewhere it stays as it is."""
    from oxserve.kernels.onednn import choose_linear_kernel, onednn_linear_supported
    from oxserve.model.common import DenseMLP

    if linear_kernel == "onednn" and not onednn_linear_supported(torch.device("cpu"), torch.bfloat16):
        with pytest.raises(ValueError, match="linear_kernel onednn needs"):  # asked for by name: a clear refusal
            choose_linear_kernel(linear_kernel, torch.device("cpu"), torch.bfloat16)
        return
    mlp = DenseMLP(64, 96, 7.0, hidden_act)
    for p in mlp.parameters():
        p.data = (torch.randn_like(p, dtype=torch.float32) * 0.1).bfloat16()
    x = torch.randn(tokens, 64).bfloat16() * 3
    dense = mlp(x)
    _, install = choose_linear_kernel(linear_kernel, torch.device("cpu"), torch.bfloat16)
    if install is not None:
        install(mlp)
    for module in reversed(list(mlp.modules())):  # as the loader does: children first
        if hasattr(module, "after_load"):
            module.after_load()
    expect_panels = PANELS and hidden_act == "silu"
    assert (mlp.panels is not None) == expect_panels and (mlp.gate_up_proj is None) == expect_panels
    torch.testing.assert_close(mlp(x).float(), dense.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tokens,top_k", [(0, 2), (1, 1), (5, 2), (40, 3), (300, 2)])
def test_a_packed_layer_routes_in_one_call_what_the_sorted_path_computes(tokens, top_k):
    """On panels, panel_routed sorts, runs and combines in C: bit-equal to sorting in torch, the
    same experts kernel and index_add_ (which sums each token's pairs in fp32, in expert order,
    and rounds once). Without panels the layer runs that sorted path itself."""
    layer = Experts(make_config(n_routed_experts=6, moe_intermediate_size=32, hidden_size=64))
    for p in layer.parameters():
        p.data = (torch.randn_like(p, dtype=torch.float32) * 0.1).bfloat16()
    layer.after_load()
    x, weights = torch.randn(tokens, 64).bfloat16(), torch.rand(tokens, top_k)
    ids = torch.rand(tokens, 6).argsort(1)[:, :top_k]
    ids[ids == 4] = 5 if top_k == 1 else ids[ids == 4]  # sometimes an expert with no rows
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    offsets = torch.bincount(flat, minlength=6).cumsum(0).to(torch.int32)
    token_of = order // top_k
    assert layer.packed == PANELS
    out = layer.run_sorted(x[token_of], weights.flatten()[order][:, None], offsets)
    want = torch.zeros_like(x).index_add_(0, token_of, out)
    assert torch.equal(layer(x, weights, ids), want)


@pytest.mark.parametrize("experts,groups,keep_groups,top_k,tokens,dtype", [
    (8, 1, 1, 2, 1, torch.bfloat16), (16, 4, 2, 3, 33, torch.float32), (64, 8, 3, 6, 7, torch.bfloat16),
    (6, 1, 1, 6, 4, torch.float32),  # every expert chosen
])
def test_native_router_chooses_and_weighs_as_the_torch_router(experts, groups, keep_groups, top_k, tokens, dtype):
    from oxserve.model.moe import Router

    router = Router(make_config(n_routed_experts=experts, n_group=groups, topk_group=keep_groups,
                                num_experts_per_tok=top_k, hidden_size=64))
    router.weight.data = torch.randn(experts, 64) * 0.2
    router.e_score_correction_bias.data = torch.randn(experts) * 0.1
    router.after_load()
    x = torch.randn(tokens, 64).to(dtype)
    assert moe.native_route_fit(x, router.weight, groups)
    weights, ids = router(x)
    want_weights, want_ids = router.route_torch(x)
    got, want = ids.sort(1), want_ids.sort(1)  # the same experts, in any order
    assert torch.equal(got.values, want.values)
    torch.testing.assert_close(weights.gather(1, got.indices), want_weights.gather(1, want.indices), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 9, 70])
def test_a_moe_layer_runs_its_shared_expert_with_the_routed_ones_as_it_adds_them(tokens):
    """On panels the shared expert runs in the routed experts' call: bit-equal to running both
    on their own and adding them (bf16 + bf16, as the layer does elsewhere)."""
    from oxserve.model.moe import MoE

    layer = MoE(make_config(n_routed_experts=6, moe_intermediate_size=32, hidden_size=64, n_shared_experts=2,
                            num_experts_per_tok=2), "test")
    for name, p in layer.named_parameters():  # a bf16 model; the router's bias stays fp32
        p.data = (torch.randn_like(p, dtype=torch.float32) * 0.1).to(torch.float32 if "bias" in name else torch.bfloat16)
    for module in reversed(list(layer.modules())):
        if hasattr(module, "after_load"):
            module.after_load()
    x = torch.randn(tokens, 64).bfloat16()
    weights, ids = layer.gate(x)
    separate = layer.experts(x, weights, ids) + layer.shared_experts(x)
    assert (layer.shared_experts.panels is not None) == PANELS == layer.experts.routes_natively
    assert torch.equal(layer(x), separate)
