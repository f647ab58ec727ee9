"""A request's caches after its prefill, as plain tensors: what a prefill instance hands a
decode instance.

    per MLA layer   the rows of its paged tables (latent, indexer keys and pool gates, pool
                    keys; int8/fp8 tables as stored: values and scales) in the request's blocks
    per KDA layer   its conv state and recurrent state (ReplaySSM rings folded in first)

The blocks go whole (the last one's unused rows too), in block-table order, so the receiver
writes them into its own blocks row for row. Both sides must store the same tables the same
way: `layout_of` describes a runner's caches, and instances compare descriptions when they
connect (a mismatch would otherwise decode garbage).

A snapshot is the whole model's, however an instance is cut among parallel ranks: each rank
exports its piece (`export_caches`), rank 0 joins them (`join_pieces`: an MLA layer's tables
from a rank that stores them, every tensor-parallel rank's KDA heads), and on import each rank
cuts its own heads out of the whole (`import_caches` with the rank's `TensorCut`). So a prefill
instance at TP 2 hands over to a decode instance at TP 1, or at Layer Split 2, unchanged.
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


@dataclass(frozen=True)
class TensorCut:
    """A rank's share of every KDA layer's heads: the `rank`-th of `size` equal runs."""

    rank: int = 0
    size: int = 1

    def conv(self, whole: torch.Tensor) -> torch.Tensor:
        """[K-1, 3 x heads x d] (q | k | v channels, each head-major) -> this rank's heads of each."""
        return whole.unflatten(-1, (3, -1)).chunk(self.size, -1)[self.rank].flatten(-2)

    def recurrent(self, whole: torch.Tensor) -> torch.Tensor:
        return whole.chunk(self.size, 0)[self.rank]


WHOLE_MODEL = TensorCut()


def _join_conv(pieces: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.unflatten(-1, (3, -1)) for p in pieces], -1).flatten(-2)


def join_pieces(pieces: list[dict[str, torch.Tensor]], tp: int) -> dict[str, torch.Tensor]:
    """The whole model's snapshot from every rank's piece (global rank order: tensor-parallel
    rank r % tp). MLA tables are the same on every rank that stores them; KDA heads are cut
    among the tensor-parallel ranks, so they come from ranks 0..tp-1 (one Layer Split group)."""
    whole: dict[str, torch.Tensor] = {}
    for piece in pieces:
        for name, t in piece.items():
            if not _is_state(name):
                whole.setdefault(name, t)
    for name in (n for n in pieces[0] if _is_state(n)):
        parts = [pieces[r][name] for r in range(tp)]
        whole[name] = _join_conv(parts) if name.endswith(".conv") else torch.cat(parts, 0)
    return whole


def needed_part(piece: dict[str, torch.Tensor], tp_rank: int, ls_rank: int) -> dict[str, torch.Tensor]:
    """What `join_pieces` takes of a rank's piece, the rest left unsent: KDA heads from the
    first Layer Split group, MLA tables from the first tensor-parallel rank of each owner."""
    return {name: t for name, t in piece.items() if (ls_rank == 0 if _is_state(name) else tp_rank == 0)}


def whole_layout(layouts: list[list[list]], tp: int) -> list[list]:
    """`layout_of` for the whole model, from the layouts of one rank per Layer Split rank (each
    describes its own MLA layers and its piece of every KDA layer)."""
    found: dict[str, tuple[tuple[int, int], list]] = {}
    for layout in layouts:
        for order, entry in enumerate(layout[1:]):
            name = entry[0]
            if name in found:
                continue
            if _is_state(name):
                shape = list(entry[2])
                shape[-1 if name.endswith(".conv") else 0] *= tp
                entry = [name, entry[1], shape, entry[3]]
            found[name] = ((int(name[1:].split(".")[0]), order), entry)
    return [layouts[0][0]] + [entry for _, entry in sorted(found.values(), key=lambda item: item[0])]


def _is_state(name: str) -> bool:
    return name.endswith((".conv", ".recurrent"))


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
    """Copies of the request's cache rows: its `blocks` and its state `slot` (this rank's piece)."""
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


def import_caches(caches: list, num_blocks: int, blocks: list[int], slot: int, tensors: dict[str, torch.Tensor],
                  cut: TensorCut = WHOLE_MODEL) -> None:  # fmt: skip
    """Write an exported request's rows (the whole model's) into this runner's `blocks` and
    state `slot`: its MLA layers' tables, and its `cut` of the KDA heads."""
    for i, cache in enumerate(caches):
        if isinstance(cache, MLACache):
            for name, table in _tables(cache):
                for part, t in _parts(f"L{i}.{name}", table):
                    rows = _block_rows(blocks, t.shape[0] // num_blocks, t.device)
                    t.index_copy_(0, rows, tensors[part].to(t.device))
        elif isinstance(cache, KDACache):
            cache.conv[slot].copy_(cut.conv(tensors[f"L{i}.conv"]))
            cache.recurrent[slot].copy_(cut.recurrent(tensors[f"L{i}.recurrent"]))
