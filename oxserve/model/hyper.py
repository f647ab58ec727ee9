"""mHC hyper-connections: each token carries N residual streams.

    streams [T,N,D] --flatten, norm, project--> pre [T,N], post [T,N], comb [T,N,N] (Sinkhorn)
    block input  = sum_n pre_n * stream_n
    new streams  = post (x) block_output + comb^T @ streams
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from oxserve.kernels.hyper import hc_gates
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
        self.gates = hc_gates  # (pre, post, comb) from the projection; a bench swaps in other versions

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T,N,D] -> (post [T,N] fp32, comb [T,N,N] fp32, block input [T,D])."""
        n = self.n
        streams_f = streams.float()
        flat = streams_f.view(streams.shape[0], -1)
        # rms-normalising a row then projecting = projecting then scaling by the row's 1/rms.
        mean_square = torch.linalg.vector_norm(flat, dim=-1, keepdim=True).square() / flat.shape[1]
        mixed = F.linear(flat, self.fn.float()) * torch.rsqrt(mean_square + self.norm_eps)
        pre, post, comb = self.gates(mixed, self.base, self.scale, n, self.sinkhorn_iters, self.hc_eps)
        collapsed = torch.bmm(pre.unsqueeze(1), streams_f).squeeze(1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def expand(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ streams
