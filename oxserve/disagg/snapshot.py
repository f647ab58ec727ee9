"""A request's caches after its prefill, as plain tensors: what a prefill instance hands a
decode instance.

    per MLA layer   the rows of its paged tables (latent, indexer keys and pool gates, pool
                    keys; int8/fp8 tables as stored: values and scales) in the request's blocks
    per KDA layer   its conv state and recurrent state (ReplaySSM rings folded in first)

The blocks go whole (the last one's unused rows too), in block-table order, so the receiver
writes them into its own blocks row for row. Both sides must store the same tables the same
way: `layout_of` describes a runner's caches, and instances compare descriptions when they
connect (a mismatch would otherwise decode garbage).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oxserve.cache.layers import KDACache, MLACache, ScaledRows, Table
from oxserve.disagg.connector import Parcel
from oxserve.kernels import kda_decode

MLA_TABLES = ("latent", "index_keys", "index_gates", "pool_keys")


@dataclass
class CacheSnapshot:
    prompt_token_ids: list[int]  # the tokens the caches hold
    first_token: int  # sampled by the prefill instance: the decode instance's first output token
    first_logprobs: dict[int, float] | None  # its logprobs, when the request asked for them
    generator_state: bytes | None  # the request's seeded sampler after that sample (None: unseeded)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def nbytes(self) -> int:
        return self.parcel().nbytes()

    def parcel(self) -> Parcel:
        """As the connector carries it."""
        lp = self.first_logprobs
        meta = {"prompt_token_ids": self.prompt_token_ids, "first_token": self.first_token,
                "first_logprobs": None if lp is None else [[k, v] for k, v in lp.items()],
                "generator_state": None if self.generator_state is None else self.generator_state.hex()}  # fmt: skip
        return Parcel(meta, self.tensors)

    @classmethod
    def of(cls, parcel: Parcel) -> CacheSnapshot:
        m = parcel.meta
        lp, state = m["first_logprobs"], m["generator_state"]
        return cls(m["prompt_token_ids"], m["first_token"], None if lp is None else {int(k): v for k, v in lp},
                   None if state is None else bytes.fromhex(state), parcel.tensors)  # fmt: skip


def _tables(cache: MLACache) -> list[tuple[str, Table]]:
    return [(name, getattr(cache, name)) for name in MLA_TABLES if getattr(cache, name) is not None]


def _parts(name: str, table: Table) -> list[tuple[str, torch.Tensor]]:
    if isinstance(table, ScaledRows):
        return [(f"{name}.values", table.values), (f"{name}.scales", table.scales)]
    return [(name, table)]


def layout_of(caches: list, num_blocks: int, block_size: int) -> list[list]:
    """What a runner's caches are, table by table: [name, dtype, row shape, rows per block]
    (rows per block 0: one per state slot). Two instances exchange caches only if equal."""
    layout: list[list] = [["block_size", block_size]]
    for i, cache in enumerate(caches):
        if isinstance(cache, MLACache):
            for name, table in _tables(cache):
                for part, t in _parts(f"L{i}.{name}", table):
                    layout.append([part, str(t.dtype), list(t.shape[1:]), t.shape[0] // num_blocks])
        elif isinstance(cache, KDACache):
            for part, t in ((f"L{i}.conv", cache.conv), (f"L{i}.recurrent", cache.recurrent)):
                layout.append([part, str(t.dtype), list(t.shape[1:]), 0])
    return layout


def _block_rows(blocks: list[int], per_block: int, device) -> torch.Tensor:
    b = torch.tensor(blocks, dtype=torch.long, device=device)
    return (b[:, None] * per_block + torch.arange(per_block, device=device)).flatten()


def export_caches(caches: list, num_blocks: int, blocks: list[int], slot: int, rings=None) -> dict[str, torch.Tensor]:
    """Copies of the request's cache rows: its `blocks` and its state `slot`."""
    out: dict[str, torch.Tensor] = {}
    pending = [rings.counts[slot]] if rings is not None else [0]  # ReplaySSM steps not yet in the state
    for i, cache in enumerate(caches):
        if isinstance(cache, MLACache):
            for name, table in _tables(cache):
                for part, t in _parts(f"L{i}.{name}", table):
                    out[part] = t.index_select(0, _block_rows(blocks, t.shape[0] // num_blocks, t.device))
        elif isinstance(cache, KDACache):
            if cache.ring is not None and pending[0]:
                slots = torch.tensor([slot], device=cache.recurrent.device)
                kda_decode.replay_fold(cache.recurrent, cache.ring, slots, pending, torch.tensor(pending, device=slots.device))
            out[f"L{i}.conv"] = cache.conv[slot].clone()
            out[f"L{i}.recurrent"] = cache.recurrent[slot].clone()
    if pending[0]:
        rings.counts[slot] = 0  # the slot's state is whole now
    return out


def import_caches(caches: list, num_blocks: int, blocks: list[int], slot: int, tensors: dict[str, torch.Tensor]) -> None:
    """Write an exported request's rows into this runner's `blocks` and state `slot`."""
    for i, cache in enumerate(caches):
        if isinstance(cache, MLACache):
            for name, table in _tables(cache):
                for part, t in _parts(f"L{i}.{name}", table):
                    rows = _block_rows(blocks, t.shape[0] // num_blocks, t.device)
                    t.index_copy_(0, rows, tensors[part].to(t.device))
        elif isinstance(cache, KDACache):
            cache.conv[slot].copy_(tensors[f"L{i}.conv"])
            cache.recurrent[slot].copy_(tensors[f"L{i}.recurrent"])
