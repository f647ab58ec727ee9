"""Per-step metadata for one flat, packed batch of tokens from many requests.

The runner builds a `ForwardBatch`; the model only reads it. Requests are ordered with
decodes (one new token on top of a cached context) first, then prefill chunks:

    tokens:   | d0 | d1 | d2 | p0 p0 p0 p0 p0 | p1 p1 p1 |
    requests:   0    1    2    3               4
    num_decodes = 3, query_start = [0, 1, 2, 3, 8, 11]

Paged cache layout (MLA latents, indexer keys): a cache row is `block * block_size + offset`;
request r's token at position p lives in row `block_tables[r, p // block_size] * block_size
+ p % block_size`. Indexer pool keys use the same blocks with `block_size // kpool` pools each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oxserve.telemetry import Tracer


@dataclass
class ForwardBatch:
    query_lens: list[int]  # new tokens per request this step
    context_lens: list[int]  # tokens already in the cache before this step
    num_decodes: int  # the first num_decodes requests are single-token decodes
    positions: torch.Tensor  # [T] long, position of each token within its request
    request_index: torch.Tensor  # [T] long, which request each token belongs to
    slot_mapping: torch.Tensor  # [T] long, cache row each token's latent is written to
    block_tables: torch.Tensor  # [R, max_blocks] long, padded with 0
    state_slots: torch.Tensor  # [R] long, KDA state slot of each request
    block_size: int
    logits_indices: torch.Tensor  # [S] long, token rows whose logits are wanted
    tracer: Tracer | None = None  # telemetry: per-op spans when profiling

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def query_start(self) -> list[int]:
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        return starts

    @property
    def seq_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]

    def rows_for_positions(self, request: int | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Cache rows of `positions` (any shape, -1 = none) for `request` (int or broadcastable tensor)."""
        safe = positions.clamp(min=0)
        blocks = self.block_tables[request, safe // self.block_size]
        return blocks * self.block_size + safe % self.block_size

    def pool_rows(self, request: int | torch.Tensor, pools: torch.Tensor, kpool: int) -> torch.Tensor:
        """Pool-cache rows of pool indices `pools` for `request`."""
        pools_per_block = self.block_size // kpool
        safe = pools.clamp(min=0)
        blocks = self.block_tables[request, safe // pools_per_block]
        return blocks * pools_per_block + safe % pools_per_block
