"""The cache objects layers read and write through: the only code that indexes cache tensors.

    MLACache (paged; row = block * block_size + offset, see ForwardBatch)
        latent      [num_blocks * block_size, kv_lora_rank]
        index_keys  [num_blocks * block_size, 2 * index_head_dim]       indexer key | pool gate score
        pool_keys   [num_blocks * block_size / kpool, index_head_dim]   one compressed key per complete pool
    KDACache (per request, row = state slot)
        conv        [num_slots, K-1, 3*H*D]   last K-1 conv inputs, oldest first
        recurrent   [num_slots, H, Dk, Dv]    fp32 delta-rule state

Layers whose indexer is `shared` have no index_keys / pool_keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MLACache:
    latent: torch.Tensor
    index_keys: torch.Tensor | None = None
    pool_keys: torch.Tensor | None = None

    def store_latents(self, rows: torch.Tensor, latents: torch.Tensor) -> None:
        self.latent[rows] = latents

    def latents(self, rows: torch.Tensor) -> torch.Tensor:
        return self.latent[rows]

    def store_index_keys(self, rows: torch.Tensor, keys: torch.Tensor, gates: torch.Tensor) -> None:
        self.index_keys[rows] = torch.cat([keys, gates], dim=-1)

    def index_keys_at(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, pool gate scores) of the tokens in `rows`."""
        return self.index_keys[rows].chunk(2, dim=-1)

    def store_pool_keys(self, pool_rows: torch.Tensor, keys: torch.Tensor) -> None:
        self.pool_keys[pool_rows] = keys

    def pool_keys_at(self, pool_rows: torch.Tensor) -> torch.Tensor:
        return self.pool_keys[pool_rows]


@dataclass
class KDACache:
    conv: torch.Tensor
    recurrent: torch.Tensor

    def conv_states(self, slots: torch.Tensor) -> torch.Tensor:
        return self.conv[slots]

    def store_conv_states(self, slots: torch.Tensor, states: torch.Tensor) -> None:
        self.conv[slots] = states

    def recurrent_states(self, slots: torch.Tensor) -> torch.Tensor:
        return self.recurrent[slots]

    def store_recurrent_states(self, slots: torch.Tensor, states: torch.Tensor) -> None:
        self.recurrent[slots] = states


LayerCache = MLACache | KDACache
