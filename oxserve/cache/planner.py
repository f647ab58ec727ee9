"""Splitting the cache memory budget, from the layers' own cache specs."""

from __future__ import annotations

import math

from oxserve.cache.spec import (
    CacheLayout,
    LayerCacheSpec,
    block_multiple,
    bytes_per_request,
    bytes_per_token,
)
from oxserve.config import CacheConfig, SchedulerConfig

DEFAULT_BLOCK_TOKENS = 64


def plan_cache(cache: CacheConfig, scheduler: SchedulerConfig, specs: list[LayerCacheSpec], max_model_len: int) -> CacheLayout:
    """One state slot per running request, the rest of the budget to paged blocks."""
    multiple = block_multiple(specs)
    block_size = cache.block_size or math.lcm(DEFAULT_BLOCK_TOKENS, multiple)
    if block_size % multiple:
        raise ValueError(f"block_size {block_size} must be a multiple of {multiple} (the indexer's k-pool)")
    num_slots = cache.num_slots or scheduler.max_num_seqs
    if cache.num_blocks is not None:
        return CacheLayout(cache.num_blocks, block_size, num_slots)
    per_block = bytes_per_token(specs) * block_size
    if per_block == 0:  # nothing is paged (no MLA layers): blocks only count tokens
        return CacheLayout(num_slots * -(-max_model_len // block_size), block_size, num_slots)
    left = cache.cache_memory_gib * 2**30 - num_slots * bytes_per_request(specs)
    num_blocks = int(left // per_block)
    if num_blocks < 1:
        raise ValueError(
            f"cache_memory_gib={cache.cache_memory_gib} cannot hold {num_slots} KDA state slots plus one block; "
            "raise it or lower max_num_seqs"
        )
    return CacheLayout(num_blocks, block_size, num_slots)
