"""mHC hyper-connections: each token carries N residual streams.

    streams [T,N,D] --flatten, norm, project--> pre [T,N], post [T,N], comb [T,N,N] (Sinkhorn)
    block input  = sum_n pre_n * stream_n
    new streams  = post (x) block_output + comb^T @ streams
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T,N,D] -> (post [T,N] fp32, comb [T,N,N] fp32, block input [T,D])."""
        n = self.n
        streams_f = streams.float()
        flat = streams_f.view(streams.shape[0], -1)
        # rms-normalising a row then projecting = projecting then scaling by the row's 1/rms.
        mean_square = torch.linalg.vector_norm(flat, dim=-1, keepdim=True).square() / flat.shape[1]
        mixed = F.linear(flat, self.fn.float()) * torch.rsqrt(mean_square + self.norm_eps)
        pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = self._sinkhorn(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n))
        collapsed = torch.bmm(pre.unsqueeze(1), streams_f).squeeze(1).to(streams.dtype)
        return post, comb, collapsed

    def _sinkhorn(self, logits: torch.Tensor) -> torch.Tensor:
        """Row softmax, then alternate column/row normalisation. Tokens go last while iterating:
        reductions over a leading axis of size N vectorise across tokens (much faster on CPU)."""
        comb = torch.softmax(logits.permute(1, 2, 0), dim=1) + self.hc_eps  # [N_in, N_out, T]
        comb = comb / (comb.sum(0, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(0, keepdim=True) + self.hc_eps)
        return comb.permute(2, 0, 1)

    @staticmethod
    def expand(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ streams
