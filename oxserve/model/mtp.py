"""The MTP (multi-token prediction) layer GLM-5.3-Flash ships after its decoder layers.

DeepSeek-V3 style, as vLLM and SGLang run it for glm5_next: one pre-norm residual block of
MLA + DSA attention (with its own indexer and cache) and MoE, on a single residual stream
(no hyper-connections). It drafts the token after next from the next token's embedding and
the target model's final (normed) hidden state at the current position:

    x = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])        embedding first
    y = x + attn(input_layernorm(x))
    z = y + moe(post_attention_layernorm(y))
    logits = lm_head(shared_head.norm(z))                    the target's head

For k > 1 drafts it runs again on its own output (normed z) and the draft token, one
position on. The embedding at position 0 is zeroed, as vLLM does: no token precedes it.
"""

from __future__ import annotations

import torch
from torch import nn

from oxserve.cache.layers import MLACache
from oxserve.cache.precision import LayerCachePrecision
from oxserve.cache.spec import MLACacheSpec
from oxserve.kernels.norm import mtp_input_norms
from oxserve.kernels.rows import add_rows
from oxserve.model.batch import ForwardBatch
from oxserve.model.common import RMSNorm
from oxserve.model.config import TextModelConfig
from oxserve.model.linear import Linear
from oxserve.model.mla import MLAttention
from oxserve.model.moe import MoE
from oxserve.parallel.tensor import SINGLE, TensorParallel


class MTPLayer(nn.Module):
    def __init__(self, cfg: TextModelConfig, index: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.eh_proj = Linear(2 * d, d)
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = MLAttention(cfg, has_indexer=True, name=f"L{index}.mla", tp=tp)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = MoE(cfg, f"L{index}.moe", tp)
        self.shared_head_norm = RMSNorm(d, eps)

    def cache_spec(self, dtype: torch.dtype, precision: LayerCachePrecision = LayerCachePrecision()) -> MLACacheSpec:
        return self.self_attn.cache_spec(dtype, precision)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, cache: MLACache) -> torch.Tensor:
        """embeds [T, D] of the next tokens, hidden [T, D] of the target (or of the previous
        draft) -> normed hidden [S, D] of the rows in batch.logits_indices, for the lm head."""
        e, h = self.enorm, self.hnorm  # [enorm(embeds, zero at position 0) ; hnorm(hidden)]
        x = self.eh_proj(mtp_input_norms(embeds, batch.positions, e.weight, e.eps, hidden, h.weight, h.eps))
        attn, _ = self.self_attn(self.input_layernorm(x), batch, cache, None)
        # Only the drafting rows go on: the others were run for the cache entries attention wrote.
        y = add_rows(x, self.tp.reduce(attn), batch.logits_indices)
        z = add_rows(y, self.tp.reduce(self.mlp(self.post_attention_layernorm(y), batch.tracer)))
        return self.shared_head_norm(z)
