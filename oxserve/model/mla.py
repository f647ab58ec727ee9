"""MLA (multi-head latent attention, no positional encoding) over DSA-selected tokens.

Attention runs in latent space: the cache holds one normalised latent c (kv_lora_rank) per
token, and kv_b_proj is folded into the query and the output instead of expanding the cache:

    score_h(t, j) = (q_h W_uk_h) . c_j * scale        W_kv_b = [W_uk; W_uv] per head
    out_h(t)      = W_uv_h (sum_j p_h(t, j) c_j)

Each query reads only the latents of its selected positions, so its cost is bounded by
index_topk + kpool - 1, not by the context length. A query with nothing selected (possible
when the incomplete tail pool is not always selected) attends to nothing: its output is 0.
"""

from __future__ import annotations

import torch
from torch import nn

from oxserve.cache.layers import MLACache
from oxserve.cache.precision import LayerCachePrecision
from oxserve.cache.spec import MLACacheSpec, PagedTensor
from oxserve.kernels.mla_attention import latent_attention, latent_attention_fit
from oxserve.kernels.moe import pack_heads, panel_heads, panel_linear_fit
from oxserve.model.batch import ForwardBatch
from oxserve.model.common import RMSNorm
from oxserve.model.config import TextModelConfig
from oxserve.model.indexer import Indexer
from oxserve.model.linear import Linear
from oxserve.parallel.tensor import SINGLE, TensorParallel
from oxserve.telemetry import span

# Queries per gather block: bounds the [block, K, kv_lora_rank] gathered latents.
QUERY_BLOCK = 256


class MLAttention(nn.Module):
    """Under tensor parallelism a rank holds its query heads (and its indexer heads); the
    latent, its projection and its cache are replicated; the output is a partial sum
    (row-parallel o_proj) for the caller to reduce."""

    def __init__(self, cfg: TextModelConfig, has_indexer: bool, name: str, tp: TensorParallel = SINGLE):
        super().__init__()
        self.name = name
        self.num_heads = tp.local(cfg.num_attention_heads, "num_attention_heads")
        self.nope_dim = cfg.qk_nope_head_dim
        self.v_dim = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = cfg.qk_head_dim**-0.5
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = Linear(cfg.q_lora_rank, cfg.num_attention_heads * cfg.qk_head_dim, tp, "column")
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.kv_lora_rank)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        kv_b_rows = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, kv_b_rows, tp, "column")
        self.o_proj = Linear(cfg.num_attention_heads * cfg.v_head_dim, cfg.hidden_size, tp, "row")
        self.indexer = Indexer(cfg, tp) if has_indexer else None
        self.w_uk: torch.Tensor | None = None  # [H, nope, C], set by after_load
        self.w_uv: torch.Tensor | None = None  # [H, v, C]
        # after_load, where the panel kernels run the dtype: w_uk^T and w_uv packed per head
        self.head_panels: tuple[torch.Tensor, torch.Tensor] | None = None

    def after_load(self) -> None:
        """Split kv_b_proj into the per-head pieces folded into query and output."""
        w_kv = self.kv_b_proj.dense_weight().view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        # contiguous: products with the split views copied them on every call
        self.w_uk, self.w_uv = (w.contiguous() for w in w_kv.split([self.nope_dim, self.v_dim], dim=1))
        w = self.w_uk
        if panel_linear_fit(w.device, w.dtype, self.nope_dim) and panel_linear_fit(w.device, w.dtype, self.kv_lora_rank):
            self.head_panels = pack_heads(self.w_uk.transpose(1, 2)), pack_heads(self.w_uv)

    def cache_spec(self, dtype: torch.dtype, precision: LayerCachePrecision = LayerCachePrecision()) -> MLACacheSpec:
        latent = PagedTensor(self.kv_lora_rank, precision.dtype("latent", dtype), read_as=dtype)
        if self.indexer is None:
            return MLACacheSpec(latent)
        return MLACacheSpec(latent, *self.indexer.cache_tensors(dtype, precision.dtype("index_keys", dtype)))

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cache: MLACache, shared_selection: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (output [T, D], the selected positions [T, K] for a following `shared` layer)."""
        tokens, tracer = x.shape[0], batch.tracer
        with span(tracer, f"{self.name}.q_proj"):
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid).view(tokens, self.num_heads, self.nope_dim)
            q_latent = self._absorb_query(q)
        with span(tracer, f"{self.name}.kv_proj"):
            cache.store_latents(batch.cache_rows, self.kv_a_layernorm(self.kv_a_proj_with_mqa(x)))
        if self.indexer is not None:
            with span(tracer, f"{self.name}.indexer"):
                selection = self.indexer(x, q_resid, batch, cache)
        elif shared_selection is not None:
            selection = shared_selection
        else:
            raise ValueError("a shared DSA layer needs the selection of the full layer before it")
        with span(tracer, f"{self.name}.attention"):
            if latent_attention_fit(q_latent, cache.latent):  # on the cache in place
                out_latent = latent_attention(q_latent, selection, batch.request_index, batch.block_tables,
                                              batch.block_size, cache.latent, self.scale)
            else:
                out_latent = torch.empty_like(q_latent)
                for s in range(0, tokens, QUERY_BLOCK):
                    e = min(s + QUERY_BLOCK, tokens)
                    out_latent[s:e] = self._attend(q_latent[s:e], selection[s:e], batch.request_index[s:e], batch, cache)
        with span(tracer, f"{self.name}.o_proj"):
            out = self._expand_output(out_latent)
            return self.o_proj(out.reshape(tokens, self.num_heads * self.v_dim)), selection

    def _absorb_query(self, q: torch.Tensor) -> torch.Tensor:
        """[T, H, nope] -> the query in latent space [T, H, C]: q_h W_uk_h per head."""
        if self.head_panels is not None:  # one native call instead of a batched GEMM's set-up
            return panel_heads(q, self.head_panels[0], self.kv_lora_rank)
        return torch.einsum("thd,hdc->thc", q, self.w_uk)

    def _expand_output(self, out_latent: torch.Tensor) -> torch.Tensor:
        """[T, H, C] -> each head's value output [T, H, v]: W_uv_h out_h."""
        if self.head_panels is not None:
            return panel_heads(out_latent, self.head_panels[1], self.v_dim)
        return torch.einsum("thc,hvc->thv", out_latent, self.w_uv)

    def _attend(self, q_latent, positions, request, batch: ForwardBatch, cache: MLACache) -> torch.Tensor:
        rows = batch.rows_for_positions(request.unsqueeze(1).expand_as(positions), positions)
        latents = cache.latents(rows)  # [t, K, C]
        scores = torch.einsum("thc,tkc->thk", q_latent, latents).float() * self.scale
        missing = (positions < 0).unsqueeze(1)
        probs = scores.masked_fill(missing, float("-inf")).softmax(-1)
        # A row with nothing selected is all -inf, and softmax makes it NaN: it attends to nothing.
        probs = probs.masked_fill(missing.all(-1, keepdim=True), 0.0).to(latents.dtype)
        return torch.einsum("thk,tkc->thc", probs, latents)
