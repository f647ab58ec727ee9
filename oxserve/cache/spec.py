"""What each layer caches, declared by the layer itself.

A layer's spec names its tensors and says how they grow: `PagedTensor`s hold one entry per
token (or per pool of tokens) in the request's paged blocks, `StateTensor`s one fixed-size
tensor per request in its state slot. The memory planner sizes the caches from these
declarations alone, and `allocate` builds the cache object the layer reads and writes
through. A different precision, a split across devices or an extra ring buffer is a
different spec and cache object, not a change to the layer's maths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from oxserve import huge_pages
from oxserve.cache.layers import QMAX, KDACache, MLACache, ReplayRing, ScaledRows, Table


@dataclass(frozen=True)
class CacheLayout:
    """How much cache there is: paged blocks of `block_size` tokens, and state slots."""

    num_blocks: int
    block_size: int
    num_slots: int


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class PagedTensor:
    """One `width`-wide entry per `tokens_per_entry` tokens, in the request's blocks. Stored
    in `dtype`; int8 and fp8 add an fp32 scale per entry and are read back as `read_as`."""

    width: int
    dtype: torch.dtype
    tokens_per_entry: int = 1
    read_as: torch.dtype | None = None  # the model's dtype, for int8 / fp8 storage

    @property
    def scaled(self) -> bool:
        return self.dtype in QMAX

    @property
    def bytes_per_token(self) -> float:
        entry = self.width * itemsize(self.dtype) + (4 if self.scaled else 0)
        return entry / self.tokens_per_entry

    def allocate(self, layout: CacheLayout, device) -> Table:
        rows = layout.num_blocks * layout.block_size // self.tokens_per_entry
        if self.scaled:
            return ScaledRows.zeros(rows, self.width, self.dtype, self.read_as or torch.float32, device)
        return huge_pages.zeros((rows, self.width), self.dtype, device)


@dataclass(frozen=True)
class StateTensor:
    """One tensor of `shape` per request, in its state slot."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    def allocate(self, layout: CacheLayout, device) -> torch.Tensor:
        return huge_pages.zeros((layout.num_slots, *self.shape), self.dtype, device)


@dataclass(frozen=True)
class MLACacheSpec:
    """An MLA layer: the normalised latent per token; with a full indexer, also each token's
    indexer key and pool gate score, and one compressed key per complete pool."""

    latent: PagedTensor
    index_keys: PagedTensor | None = None
    index_gates: PagedTensor | None = None
    pool_keys: PagedTensor | None = None

    @property
    def paged(self) -> tuple[PagedTensor, ...]:
        return tuple(t for t in (self.latent, self.index_keys, self.index_gates, self.pool_keys) if t is not None)

    @property
    def states(self) -> tuple[StateTensor, ...]:
        return ()

    def allocate(self, layout: CacheLayout, device) -> MLACache:
        def make(t: PagedTensor | None):
            return None if t is None else t.allocate(layout, device)

        return MLACache(make(self.latent), make(self.index_keys), make(self.index_gates), make(self.pool_keys))


@dataclass(frozen=True)
class ReplayRingSpec:
    """ReplaySSM's ring: `length` steps of (key, cumulative log-decay, update) per request."""

    length: int
    heads: int
    key_dim: int
    value_dim: int
    exact: bool  # keep plain keys (any decay) rather than keys times exp(-G)

    @property
    def tensors(self) -> tuple[StateTensor, ...]:
        keys = StateTensor((self.heads, self.length, self.key_dim), torch.float32)
        deltas = StateTensor((self.heads, self.length, self.value_dim), torch.float32)
        return keys, keys, deltas  # keys, log-decays, deltas

    def allocate(self, layout: CacheLayout, device) -> ReplayRing:
        keys, decays, deltas = (t.allocate(layout, device) for t in self.tensors)
        return ReplayRing(keys, decays, deltas, self.exact)


@dataclass(frozen=True)
class KDACacheSpec:
    """A KDA layer: the last K-1 conv inputs and the fp32 delta-rule state, per request;
    with ReplaySSM, the state is a checkpoint and a ring holds the steps since."""

    conv: StateTensor
    recurrent: StateTensor
    ring: ReplayRingSpec | None = None

    @property
    def paged(self) -> tuple[PagedTensor, ...]:
        return ()

    @property
    def states(self) -> tuple[StateTensor, ...]:
        return (self.conv, self.recurrent) + (self.ring.tensors if self.ring else ())

    def allocate(self, layout: CacheLayout, device) -> KDACache:
        ring = self.ring.allocate(layout, device) if self.ring else None
        return KDACache(self.conv.allocate(layout, device), self.recurrent.allocate(layout, device), ring)


@dataclass(frozen=True)
class ElsewhereCacheSpec:
    """A layer whose cache another rank holds (Layer Split): nothing here."""

    paged: tuple[PagedTensor, ...] = ()
    states: tuple[StateTensor, ...] = ()

    def allocate(self, layout: CacheLayout, device) -> None:
        return None


LayerCacheSpec = MLACacheSpec | KDACacheSpec | ElsewhereCacheSpec


def replay_length(specs: list[LayerCacheSpec]) -> int:
    """The ReplaySSM ring length of these layers (0: they write their states back)."""
    return max((spec.ring.length for spec in specs if isinstance(spec, KDACacheSpec) and spec.ring), default=0)


def bytes_per_token(specs: list[LayerCacheSpec]) -> float:
    return sum(t.bytes_per_token for spec in specs for t in spec.paged)


def bytes_per_request(specs: list[LayerCacheSpec]) -> int:
    return sum(t.bytes for spec in specs for t in spec.states)


def block_multiple(specs: list[LayerCacheSpec]) -> int:
    """Block sizes must hold whole entries of every paged tensor."""
    return math.lcm(1, *(t.tokens_per_entry for spec in specs for t in spec.paged))
