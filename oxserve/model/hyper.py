"""mHC hyper-connections: each token carries N residual streams (the math is in
`oxserve.kernels.hyper`, with its diagram).

    streams [T,N,D] --flatten, norm, project--> pre [T,N], post [T,N], comb [T,N,N] (Sinkhorn)
    block input  = sum_n pre_n * stream_n
    new streams  = post (x) block_output + comb^T @ streams
"""

from __future__ import annotations

import torch
from torch import nn

from oxserve.kernels.hyper import hc_collapse, hc_expand
from oxserve.model.common import RMSNorm
from oxserve.model.linear import empty_param, loadable


class HyperConnection(nn.Module):
    def __init__(self, hidden: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        n = hc_mult
        self.n = n
        self.fn = loadable(empty_param((2 + n) * n, n * hidden))
        self.base = loadable(empty_param((2 + n) * n, dtype=torch.float32))
        self.scale = loadable(empty_param(3, dtype=torch.float32))
        self.sinkhorn_iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        self.collapse_kernel = hc_collapse  # a bench swaps in other versions

    def collapse(self, streams: torch.Tensor, norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T,N,D] -> (post [T,N] fp32, comb [T,N,N] fp32, block input [T,D], after
        `norm` when given: fused into the collapse where it runs natively)."""
        block_norm = None if norm is None else (norm.weight, norm.eps)
        return self.collapse_kernel(streams, self.fn, self.base, self.scale, self.sinkhorn_iters, self.hc_eps,
                                    self.norm_eps, block_norm)

    def after_load(self) -> None:
        """fn in fp32, which the projection computes in (exact; saves a conversion a call)."""
        self.fn.data = self.fn.data.float()

    @staticmethod
    def expand(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        return hc_expand(post, comb, block_out, streams)
