"""Small building blocks shared by the glm5_next layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from oxserve.kernels.moe import clamped_swiglu


def empty_param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    """Normalise in fp32, cast back, then scale (the reference's order of operations)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = empty_param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Linear(nn.Module):
    """A bias-free projection whose weight a loader fills (possibly from several checkpoint tensors)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = empty_param(out_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, swiglu_limit: float):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate)  # [gate; up], fused at load time
        self.down_proj = Linear(intermediate, hidden)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(clamped_swiglu(gate, up, self.swiglu_limit))
