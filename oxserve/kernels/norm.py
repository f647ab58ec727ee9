"""RMSNorm, as the reference computes it: normalise in fp32, cast back, then scale."""

from __future__ import annotations

import torch

from oxserve.kernels.rows import mean_rms_norm_fit, mean_rms_norm_native, rms_norm_fit, rms_norm_native


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One native pass for bf16 on CPU (8 eager ops otherwise)."""
    if rms_norm_fit(x, weight):
        return rms_norm_native(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def mean_rms_norm(streams: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(streams[rows].mean(1)): the final norm over the hyper-connection streams
    [T, S, D] of the rows wanted, one native pass for bf16 on CPU (3 eager ops otherwise)."""
    if mean_rms_norm_fit(streams, weight):
        return mean_rms_norm_native(streams, rows, weight, eps)
    return rms_norm(streams[rows].mean(1), weight, eps)
