"""RMSNorm, as the reference computes it: normalise in fp32, cast back, then scale."""

from __future__ import annotations

import torch

from oxserve.kernels.rows import mean_rms_norm_fit, mean_rms_norm_native, mtp_input_norms_native, rms_norm_fit, rms_norm_native


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One native pass for bf16 on CPU (8 eager ops otherwise)."""
    if rms_norm_fit(x, weight):
        return rms_norm_native(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def mtp_input_norms(embeds: torch.Tensor, positions: torch.Tensor, embed_weight: torch.Tensor, embed_eps: float,
                    hidden: torch.Tensor, hidden_weight: torch.Tensor, hidden_eps: float) -> torch.Tensor:
    """[rms_norm(embeds, zeroed at position 0) ; rms_norm(hidden)] along the last dim, embeds
    and hidden [T, D]: the MTP layer's input, one native pass for bf16 on CPU (5 eager ops
    otherwise)."""
    if embeds.dim() == 2 and rms_norm_fit(embeds, embed_weight) and rms_norm_fit(hidden, hidden_weight):
        return mtp_input_norms_native(embeds, positions, embed_weight, embed_eps, hidden, hidden_weight, hidden_eps)
    embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)
    return torch.cat([rms_norm(embeds, embed_weight, embed_eps), rms_norm(hidden, hidden_weight, hidden_eps)], dim=-1)


def mean_rms_norm(streams: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(streams[rows].mean(1)): the final norm over the hyper-connection streams
    [T, S, D] of the rows wanted, one native pass for bf16 on CPU (3 eager ops otherwise)."""
    if mean_rms_norm_fit(streams, weight):
        return mean_rms_norm_native(streams, rows, weight, eps)
    return rms_norm(streams[rows].mean(1), weight, eps)
