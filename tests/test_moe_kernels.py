"""Grouped expert GEMMs against the per-expert loop, and the router against its definition."""

import pytest
import torch

from oxserve.kernels.moe import grouped_experts, looped_experts


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
