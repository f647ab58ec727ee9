"""DSA indexer with k-pool compression: which cached tokens each query attends to.

Pools group a request's tokens from its first token on: pool j = positions [jP, jP+P).
A complete pool gets one compressed key (softmax-weighted mean of its tokens' keys,
weights from a learned gate + per-offset bias), computed once when its last token arrives
and kept in the pool cache. A query at position t scores the pools that end at or before
t, keeps the best min(index_topk / P, #pools) (all of them, unscored, while a step's requests
have no more pools than that; among equal scores the lower pool), expands them to their P
positions and, when `index_kpool_always_select_tail`, adds the tokens of its own incomplete
pool (the tail):

    positions:  0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13      query t = 13, P = 4
    pools:        p0    |   p1    |    p2     |  tail = {12, 13}

The selection is returned as positions [T, K] with -1 for "nothing here".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from oxserve.cache.layers import MLACache
from oxserve.cache.spec import PagedTensor
from oxserve.kernels.dsa_index import (expand_selection, index_scores, index_scores_fit, select_every_pool, store_keys,
                                       store_keys_fit, top_pools)
from oxserve.kernels.moe import pack_linear, panel_linear, panel_linear_fit
from oxserve.model.batch import ForwardBatch, PoolCompletions
from oxserve.model.config import TextModelConfig
from oxserve.model.linear import Linear, empty_param, loadable
from oxserve.parallel.tensor import SINGLE, TensorParallel


class Indexer(nn.Module):
    """Under tensor parallelism a rank scores with its own heads; the head-weighted sums are
    reduced across ranks before top-k, so every rank selects the same positions."""

    def __init__(self, cfg: TextModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.n_heads = tp.local(cfg.index_n_heads, "index_n_heads")
        self.head_weight_scale = cfg.index_n_heads**-0.5  # over all heads, wherever they are
        self.head_dim = cfg.index_head_dim
        self.kpool = cfg.index_kpool
        self.max_pools = cfg.index_topk // cfg.index_kpool
        self.with_tail = cfg.index_kpool_always_select_tail
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, tp, "column")
        self.wk = Linear(cfg.hidden_size, cfg.index_head_dim)
        self.k_norm_weight = loadable(empty_param(cfg.index_head_dim))
        self.k_norm_bias = loadable(empty_param(cfg.index_head_dim))
        self.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads, tp, "column")
        self.compress_ape = loadable(empty_param(cfg.index_kpool, cfg.index_head_dim))
        self.compress_gate = loadable(empty_param(cfg.index_head_dim, cfg.hidden_size))
        self.native_scores = True  # decode scores by `kernels.dsa_index` where it fits; a bench times the torch form
        self.native_store = True  # keys stored and pools compressed by `kernels.dsa_index` where it fits
        self.gate_panels: torch.Tensor | None = None  # compress_gate packed for the panel kernel (after_load)

    def after_load(self) -> None:
        """The pool gate's product on the panel kernel where it runs the dtype: a plain bf16
        `F.linear` pays a oneDNN set-up (120 us a call at batch 32 on the AMD EPYC)."""
        gate = self.compress_gate.detach()
        if panel_linear_fit(gate.device, gate.dtype, gate.shape[1]):
            self.gate_panels = pack_linear(gate)

    def cache_tensors(self, dtype: torch.dtype, key_dtype: torch.dtype) -> tuple[PagedTensor, PagedTensor, PagedTensor]:
        """(each token's key, its pool gate score, one compressed key per complete pool); the
        keys stored in key_dtype."""
        return (
            PagedTensor(self.head_dim, key_dtype, read_as=dtype),
            PagedTensor(self.head_dim, dtype),
            PagedTensor(self.head_dim, key_dtype, tokens_per_entry=self.kpool, read_as=dtype),
        )

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, batch: ForwardBatch, cache: MLACache) -> torch.Tensor:
        self._write_keys(x, batch, cache)
        bound = batch.seq_len_bound  # >= every sequence of the step: pools past a query's own are hidden
        if bound // self.kpool <= self.max_pools:  # top-k would keep every pool: no scores needed
            return select_every_pool(batch.positions, bound // self.kpool, self.kpool, self.with_tail)
        q = self.wq_b(q_resid).view(x.shape[0], self.n_heads, self.head_dim)
        head_weights = self.weights_proj(x)  # as projected: `_select` scales them
        pos = batch.positions
        parts = []
        starts = batch.query_start
        # Decodes and verifies (a few queries per request) in one call, each row with its own
        # request; prefill chunks one request at a time, sharing its pool keys.
        nb = batch.num_decodes + batch.num_verifies
        if nb:
            rows = starts[nb]
            parts.append(self._select(q[:rows], head_weights[:rows], pos[:rows], batch, batch.request_index[:rows],
                                      batch.seq_len_bound, cache))  # fmt: skip
        for r in range(nb, batch.num_requests):  # prefill chunks: a host-side loop, in steps never captured
            s, e = starts[r], starts[r + 1]
            parts.append(self._select(q[s:e], head_weights[s:e], pos[s:e], batch, r, batch.seq_lens[r], cache))
        if len(parts) == 1:
            return parts[0]
        width = max(p.shape[1] for p in parts)
        return torch.cat([F.pad(p, (0, width - p.shape[1]), value=-1) for p in parts])

    def _write_keys(self, x: torch.Tensor, batch: ForwardBatch, cache: MLACache) -> None:
        self.store_step_keys(self.wk(x), self._pool_gates(x), batch.cache_rows, batch.pools, cache)

    def store_step_keys(self, raw: torch.Tensor, gates: torch.Tensor, rows: torch.Tensor, pools: PoolCompletions,
                   cache: MLACache) -> None:
        """Store a step's token keys (`raw`, before their norm) and pool gate scores at `rows`,
        then compress every pool the step completed."""
        if self.native_store and store_keys_fit(raw, cache.index_keys, cache.index_gates, cache.pool_keys, gates,
                                                self.k_norm_weight, self.k_norm_bias, self.compress_ape):
            store_keys(raw, gates, self.k_norm_weight, self.k_norm_bias, 1e-6, rows, cache.index_keys, cache.index_gates,
                       pools.member_rows, pools.pool_rows, self.compress_ape, cache.pool_keys)
            return
        keys = F.layer_norm(raw, (self.head_dim,), self.k_norm_weight, self.k_norm_bias, eps=1e-6)
        cache.store_index_keys(rows, keys, gates)
        if pools.pool_rows.numel() == 0:
            return
        pool_keys, pool_gates = cache.index_keys_at(pools.member_rows)  # [N, P, Dk] each
        probs = (pool_gates.float() + self.compress_ape.float()).softmax(dim=1).to(pool_keys.dtype)
        cache.store_pool_keys(pools.pool_rows, (probs * pool_keys).sum(1))

    def _pool_gates(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_panels is not None:
            return panel_linear(x, self.gate_panels, self.head_dim)
        return F.linear(x, self.compress_gate)

    def _select(self, q, head_weights, query_pos, batch: ForwardBatch, request, longest: int, cache: MLACache) -> torch.Tensor:
        """Pick positions for a group of queries; `longest` bounds their sequence lengths (host-side).

        Decodes and verifies: `request` is a tensor, each query's request index.
        Prefill: all queries from one request, `request` is an int; they share its pool keys.
        """
        num_pools = longest // self.kpool
        k = min(self.max_pools, num_pools)
        scale = self.head_dim**-0.5
        if self.native_scores and not isinstance(request, int) and index_scores_fit(q, head_weights, cache.pool_keys):
            pool_scores = self.tp.reduce(index_scores(q, head_weights, query_pos, self.kpool, request, batch.block_tables,
                                                      batch.block_size // self.kpool, cache.pool_keys, num_pools, scale,
                                                      self.head_weight_scale, hidden=float("-inf")))  # fmt: skip
            chosen = top_pools(pool_scores, k, hidden_from=(query_pos, self.kpool))
            return expand_selection(chosen, None, query_pos, self.kpool, self.with_tail)
        q, head_weights = q.float(), head_weights.float() * self.head_weight_scale
        visible_pools = (query_pos + 1) // self.kpool
        pool_ids = torch.arange(num_pools, device=q.device)
        if isinstance(request, int):
            keys = cache.pool_keys_at(batch.pool_rows(request, pool_ids, self.kpool)).float().unsqueeze(0)
        else:
            # A shorter request's pools end early: read its last pool there (masked below),
            # never past its own blocks.
            grid = torch.minimum(pool_ids, (visible_pools - 1).clamp(min=0).unsqueeze(1))
            keys = cache.pool_keys_at(batch.pool_rows(request.unsqueeze(1).expand_as(grid), grid, self.kpool)).float()
        # [N, H, Dk] x [N|1, P, Dk] -> [N, H, P]; relu per head, then the weighted head sum. A
        # prefill chunk's queries share one request's keys: one GEMM, not N broadcast products.
        if isinstance(request, int):
            scores = F.relu((q.reshape(-1, q.shape[-1]) @ keys[0].T).view(*q.shape[:2], -1) * scale)
        else:
            scores = F.relu(torch.matmul(q, keys.transpose(1, 2)) * scale)
        head_sums = (head_weights.unsqueeze(1) @ scores).squeeze(1)
        visible = pool_ids.unsqueeze(0) < visible_pools.unsqueeze(1)
        pool_scores = self.tp.reduce(head_sums).masked_fill(~visible, float("-inf"))
        return expand_selection(top_pools(pool_scores, k), visible_pools, query_pos, self.kpool, self.with_tail)
