"""Grouped expert GEMMs against the per-expert loop, and the router against its definition."""

import pytest
import torch

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
    """The grouped GEMM needs 16-byte aligned rows; other sizes must still run (looped)."""
    assert grouped_gemm_supported(torch.device("cpu"), dtype, 64, inter) is grouped
    experts = Experts(make_config(n_routed_experts=4, moe_intermediate_size=inter, hidden_size=64))
    for p in experts.parameters():
        p.data = torch.randn_like(p, dtype=dtype) * 0.1
    x = torch.randn(5, 64, dtype=dtype)
    weights, ids = torch.rand(5, 2), torch.randint(0, 4, (5, 2))
    out = experts(x, weights, ids)
    ref = torch.zeros(5, 64)
    for t in range(5):
        for w, e in zip(weights[t], ids[t]):
            g, u = (experts.gate_up_proj[e].float() @ x[t].float()).chunk(2)
            ref[t] += experts.down_proj[e].float() @ (torch.nn.functional.silu(g.clamp(max=10)) * u.clamp(-10, 10) * w)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
