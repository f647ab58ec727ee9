"""The tensors behind prefix caching: the KDA checkpoint store, and the cache operations.

    CheckpointStore (per KDA layer, row = checkpoint id, see `oxserve.cache.checkpoints`)
        conv        [num_checkpoints, K-1, 3*H*D]   in the conv state's dtype
        recurrent   [num_checkpoints, H, Dk, Dv]    in the recurrent state's dtype

`apply_cache_ops` runs a step's `CacheOps` before its forward, in order: saves (state slot ->
checkpoint row; with ReplaySSM the slot's pending ring entries are folded into its state
first, so that the row holds the full state), restores (checkpoint row -> state slot, ring
empty), then block copies (every paged table's rows of one block into another's).
"""

from __future__ import annotations

import torch

from oxserve.cache.layers import LayerCache, MLACache, ScaledRows, gather_rows, scatter_rows
from oxserve.cache.manager import CacheOps
from oxserve.cache.replay import ReplayBook
from oxserve.cache.spec import KDACacheSpec, LayerCacheSpec
from oxserve.kernels import kda_decode


class CheckpointStore:
    def __init__(self, specs: list[LayerCacheSpec], num_checkpoints: int, device):
        self.device = device

        # Empty, not zeros: a row's pages are committed when a checkpoint is first written, so
        # a budget that is never used costs no resident memory (zeroed, the default 0.5 GiB
        # made decode 5-7% slower on a workload without shared prefixes: docs/prefix-caching.md).
        # A row is read only after it was saved.
        def rows(t):
            return torch.empty(num_checkpoints, *t.shape, dtype=t.dtype, device=device)

        # One (conv, recurrent) pair per KDA layer, in layer order; None for other layers.
        self.states = [(rows(s.conv), rows(s.recurrent)) if isinstance(s, KDACacheSpec) else None for s in specs]

    def apply(self, ops: CacheOps, caches: list[LayerCache], rings: ReplayBook | None, num_blocks: int) -> None:
        if ops.saves:
            self._save(ops.saves, caches, rings)
        if ops.restores:
            self._restore(ops.restores, caches, rings)
        if ops.copies:
            copy_blocks(ops.copies, caches, num_blocks, self.device)

    def _save(self, saves: list[tuple[int, int]], caches: list[LayerCache], rings: ReplayBook | None) -> None:
        slots, rows = self._long([s for s, _ in saves]), self._long([r for _, r in saves])
        pending = [rings.counts[s] for s, _ in saves] if rings is not None else []
        for cache, state in zip(caches, self.states):
            if state is None:
                continue
            if rings is not None and cache.ring is not None:
                kda_decode.replay_fold(cache.recurrent, cache.ring, slots, pending, self._long(pending))
            conv, recurrent = state
            conv.index_copy_(0, rows, gather_rows(cache.conv, slots))
            recurrent.index_copy_(0, rows, gather_rows(cache.recurrent, slots))
        _empty_rings(rings, [s for s, _ in saves])  # the slot now holds its full state

    def _restore(self, restores: list[tuple[int, int]], caches: list[LayerCache], rings: ReplayBook | None) -> None:
        rows, slots = self._long([r for r, _ in restores]), self._long([s for _, s in restores])
        for cache, state in zip(caches, self.states):
            if state is None:
                continue
            conv, recurrent = state
            scatter_rows(cache.conv, slots, conv.index_select(0, rows))
            scatter_rows(cache.recurrent, slots, recurrent.index_select(0, rows))
        _empty_rings(rings, [s for _, s in restores])

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _empty_rings(rings: ReplayBook | None, slots: list[int]) -> None:
    if rings is not None:
        for slot in slots:
            rings.counts[slot] = 0


def copy_blocks(pairs: list[tuple[int, int]], caches: list[LayerCache], num_blocks: int, device) -> None:
    """Every paged table's rows of each source block into its destination block (a table
    holds num_rows / num_blocks rows per block: one per token, or per indexer pool)."""
    src = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=device)
    dst = torch.tensor([b for _, b in pairs], dtype=torch.long, device=device)
    for cache in caches:
        if not isinstance(cache, MLACache):
            continue
        for table in (cache.latent, cache.index_keys, cache.index_gates, cache.pool_keys):
            if table is None:
                continue
            per_block = (table.values if isinstance(table, ScaledRows) else table).shape[0] // num_blocks
            offsets = torch.arange(per_block, device=device)
            rows_from = (src[:, None] * per_block + offsets).flatten()
            rows_to = (dst[:, None] * per_block + offsets).flatten()
            if isinstance(table, ScaledRows):  # stored values and scales as they are: no requantization
                table.values.index_copy_(0, rows_to, table.values.index_select(0, rows_from))
                table.scales.index_copy_(0, rows_to, table.scales.index_select(0, rows_from))
            else:
                table.index_copy_(0, rows_to, table.index_select(0, rows_from))
