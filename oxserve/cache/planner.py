"""Splitting the cache memory budgets (blocks and slots; prefix checkpoints), from the layers' own cache specs."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from oxserve.cache.manager import PrefixCaching
from oxserve.cache.spec import (
    CacheLayout,
    KDACacheSpec,
    LayerCacheSpec,
    block_multiple,
    bytes_per_request,
    bytes_per_token,
)
from oxserve.config import CacheConfig, SchedulerConfig

DEFAULT_BLOCK_TOKENS = 64


def plan_cache(cache: CacheConfig, scheduler: SchedulerConfig, specs: list[LayerCacheSpec], max_model_len: int,
               spare: int = 0) -> CacheLayout:  # fmt: skip
    """One state slot per running request, the rest of the budget to paged blocks, less
    `spare` slots and blocks that the runner adds for itself (padding rows: `engine.padding`)."""
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
    left = cache.cache_memory_gib * 2**30 - (num_slots + spare) * bytes_per_request(specs)
    num_blocks = int(left // per_block) - spare
    if num_blocks < 1:
        raise ValueError(
            f"cache_memory_gib={cache.cache_memory_gib} cannot hold {num_slots + spare} KDA state slots plus "
            f"{1 + spare} block(s); "
            "raise it or lower max_num_seqs"
        )
    return CacheLayout(num_blocks, block_size, num_slots)


def plan_split_cache(cache: CacheConfig, scheduler: SchedulerConfig, specs_by_rank: list[list[LayerCacheSpec]],
                     max_model_len: int, spare: int = 0) -> CacheLayout:  # fmt: skip
    """`plan_cache` when each rank caches other layers (Layer Split), with `cache_memory_gib`
    per rank: the same block size everywhere, and the blocks the fullest rank can hold."""
    multiple = block_multiple([spec for specs in specs_by_rank for spec in specs])
    cache = replace(cache, block_size=cache.block_size or math.lcm(DEFAULT_BLOCK_TOKENS, multiple))
    layouts = [plan_cache(cache, scheduler, specs, max_model_len, spare) for specs in specs_by_rank]
    return min(layouts, key=lambda layout: layout.num_blocks)


def kda_state_bytes(specs: list[LayerCacheSpec]) -> int:
    """One request's KDA conv and recurrent states over every layer (a checkpoint's size)."""
    return sum(spec.conv.bytes + spec.recurrent.bytes for spec in specs if isinstance(spec, KDACacheSpec))


def plan_prefix_caching(cache: CacheConfig, specs: list[LayerCacheSpec], layout: CacheLayout,
                        prefill_cost: Callable[[int], float]) -> PrefixCaching | None:
    """The checkpoint pool from its own budget (prefix_checkpoint_gib); None when prefix
    caching is off. A model without KDA layers needs no states: its checkpoints only pin
    partial blocks, and there are as many of them as a quarter of the blocks."""
    if not cache.enable_prefix_caching:
        return None
    state = kda_state_bytes(specs)
    count = int(cache.prefix_checkpoint_gib * 2**30 // state) if state else max(1, layout.num_blocks // 4)
    if count < 1:
        raise ValueError(f"prefix_checkpoint_gib={cache.prefix_checkpoint_gib} cannot hold one KDA checkpoint "
                         f"({state / 2**20:.1f} MiB); raise it or turn prefix caching off")
    return PrefixCaching(
        num_checkpoints=count,
        state_bytes=state,
        block_bytes=int(bytes_per_token(specs) * layout.block_size),
        prefill_cost=prefill_cost,
        policy=cache.prefix_checkpoint_policy,
        alpha=cache.prefix_checkpoint_alpha,
        interval=cache.prefix_checkpoint_interval,
    )
