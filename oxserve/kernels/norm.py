"""RMSNorm, as the reference computes it: normalise in fp32, cast back, then scale."""

from __future__ import annotations

import torch

from oxserve.kernels.rows import rms_norm_fit, rms_norm_native


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One native pass for bf16 on CPU (8 eager ops otherwise)."""
    if rms_norm_fit(x, weight):
        return rms_norm_native(x, weight, eps)
    return rms_norm_torch(x, weight, eps)
