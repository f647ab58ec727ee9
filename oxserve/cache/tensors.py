"""The cache tensors each layer reads and writes, preallocated once.

KDA layers keep fixed-size per-request state in slots:
    conv      [num_slots, K-1, 3*H*D]   last K-1 conv inputs, oldest first
    recurrent [num_slots, H, Dk, Dv]    fp32 delta-rule state

MLA layers keep per-token data in paged blocks (row = block * block_size + offset):
    latent      [num_blocks * block_size, kv_lora_rank]
    index_keys  [num_blocks * block_size, 2 * index_head_dim]   indexer key | pool gate score
    pool_keys   [num_blocks * block_size / kpool, index_head_dim]  one compressed key per complete pool
Layers whose indexer is `shared` have no index_keys / pool_keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oxserve.model.config import TextModelConfig


@dataclass
class KDALayerCache:
    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass
class MLALayerCache:
    latent: torch.Tensor
    index_keys: torch.Tensor | None
    pool_keys: torch.Tensor | None


LayerCache = KDALayerCache | MLALayerCache


def kda_slot_bytes(cfg: TextModelConfig, dtype: torch.dtype) -> int:
    """Bytes of KDA state one request holds across all KDA layers."""
    conv = (cfg.linear_conv_kernel_dim - 1) * 3 * cfg.kda_dim * _itemsize(dtype)
    recurrent = cfg.linear_num_heads * cfg.linear_head_dim * cfg.linear_head_dim * 4
    return len(cfg.kda_layers) * (conv + recurrent)


def mla_token_bytes(cfg: TextModelConfig, dtype: torch.dtype) -> float:
    """Bytes of paged cache one token takes across all MLA layers."""
    size = _itemsize(dtype)
    per_layer = cfg.kv_lora_rank * size
    indexer = (2 * cfg.index_head_dim + cfg.index_head_dim / cfg.index_kpool) * size
    return len(cfg.mla_layers) * per_layer + len(cfg.full_indexer_layers) * indexer


def allocate_layer_caches(
    cfg: TextModelConfig, num_blocks: int, block_size: int, num_slots: int, dtype: torch.dtype, device: torch.device | str
) -> list[LayerCache]:
    if block_size % cfg.index_kpool:
        raise ValueError(f"block_size ({block_size}) must be a multiple of index_kpool ({cfg.index_kpool})")
    rows = num_blocks * block_size
    caches: list[LayerCache] = []
    for i in range(cfg.num_hidden_layers):
        if cfg.is_mla_layer(i):
            full = cfg.is_full_indexer_layer(i)
            caches.append(
                MLALayerCache(
                    latent=torch.zeros(rows, cfg.kv_lora_rank, dtype=dtype, device=device),
                    index_keys=torch.zeros(rows, 2 * cfg.index_head_dim, dtype=dtype, device=device) if full else None,
                    pool_keys=(
                        torch.zeros(rows // cfg.index_kpool, cfg.index_head_dim, dtype=dtype, device=device) if full else None
                    ),
                )
            )
        else:
            h, d = cfg.linear_num_heads, cfg.linear_head_dim
            caches.append(
                KDALayerCache(
                    conv=torch.zeros(num_slots, cfg.linear_conv_kernel_dim - 1, 3 * cfg.kda_dim, dtype=dtype, device=device),
                    recurrent=torch.zeros(num_slots, h, d, d, dtype=torch.float32, device=device),
                )
            )
    return caches


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
