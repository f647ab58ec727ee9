"""The cache objects layers read and write through: the only code that indexes cache tensors.

    MLACache (paged; row = block * block_size + offset, see ForwardBatch)
        latent      [num_blocks * block_size, kv_lora_rank]
        index_keys  [num_blocks * block_size, 2 * index_head_dim]       indexer key | pool gate score
        pool_keys   [num_blocks * block_size / kpool, index_head_dim]   one compressed key per complete pool
    KDACache (per request, row = state slot)
        conv        [num_slots, K-1, 3*H*D]   last K-1 conv inputs, oldest first
        recurrent   [num_slots, H, Dk, Dv]    fp32 delta-rule state

Layers whose indexer is `shared` have no index_keys / pool_keys. Reads and writes go
through index_select / index_copy_ (2-3x faster than advanced indexing on CPU); the rows a
step writes are distinct.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def gather_rows(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """table[rows] for row indices of any shape."""
    return table.index_select(0, rows.flatten()).view(*rows.shape, *table.shape[1:])


def scatter_rows(table: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """table[rows] = values, for distinct row indices of any shape."""
    table.index_copy_(0, rows.flatten(), values.reshape(rows.numel(), *table.shape[1:]).to(table.dtype))


@dataclass
class MLACache:
    latent: torch.Tensor
    index_keys: torch.Tensor | None = None
    pool_keys: torch.Tensor | None = None

    def store_latents(self, rows: torch.Tensor, latents: torch.Tensor) -> None:
        scatter_rows(self.latent, rows, latents)

    def latents(self, rows: torch.Tensor) -> torch.Tensor:
        return gather_rows(self.latent, rows)

    def store_index_keys(self, rows: torch.Tensor, keys: torch.Tensor, gates: torch.Tensor) -> None:
        scatter_rows(self.index_keys, rows, torch.cat([keys, gates], dim=-1))

    def index_keys_at(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, pool gate scores) of the tokens in `rows`."""
        return gather_rows(self.index_keys, rows).chunk(2, dim=-1)

    def store_pool_keys(self, pool_rows: torch.Tensor, keys: torch.Tensor) -> None:
        scatter_rows(self.pool_keys, pool_rows, keys)

    def pool_keys_at(self, pool_rows: torch.Tensor) -> torch.Tensor:
        return gather_rows(self.pool_keys, pool_rows)


@dataclass
class KDACache:
    conv: torch.Tensor
    recurrent: torch.Tensor

    def conv_states(self, slots: torch.Tensor) -> torch.Tensor:
        return gather_rows(self.conv, slots)

    def store_conv_states(self, slots: torch.Tensor, states: torch.Tensor) -> None:
        scatter_rows(self.conv, slots, states)

    def recurrent_states(self, slots: torch.Tensor) -> torch.Tensor:
        return gather_rows(self.recurrent, slots)

    def store_recurrent_states(self, slots: torch.Tensor, states: torch.Tensor) -> None:
        scatter_rows(self.recurrent, slots, states)


LayerCache = MLACache | KDACache
