"""Small building blocks shared by the glm5_next layers."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from oxserve.kernels.moe import clamped_glu
from oxserve.model.linear import Linear, empty_param, loadable
from oxserve.parallel.tensor import SINGLE, TensorParallel


class RMSNorm(nn.Module):
    """Normalise in fp32, cast back, then scale (the reference's order of operations)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = loadable(empty_param(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class DenseMLP(nn.Module):
    """act(clamp(gate)) * clamp(up), projected down: the dense layers and the shared experts.
    Under tensor parallelism a rank holds its share of the intermediate channels, and its
    output is a partial sum for the caller to reduce."""

    def __init__(self, hidden: int, intermediate: int, swiglu_limit: float, act: Callable[[torch.Tensor], torch.Tensor],
                 tp: TensorParallel = SINGLE):  # fmt: skip
        super().__init__()
        self.intermediate = tp.local(intermediate, "intermediate size")
        self.gate_up_proj = Linear(hidden, (intermediate, intermediate), tp, "column")  # [gate; up], fused at load time
        self.down_proj = Linear(intermediate, hidden, tp, "row")
        self.swiglu_limit = swiglu_limit
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(clamped_glu(gate, up, self.swiglu_limit, self.act))
