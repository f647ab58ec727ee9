"""Layer Split: the MLA caches cut by layer among ranks, each rank holding only its own layers'.

The MLA latent (and the indexer's keys) is the same for every query head, so tensor
parallelism replicates it: every rank stores every layer's cache. Under Layer Split each
MLA layer has one owner among `size` ranks, which alone stores its cache and runs its
attention (indexer and top-k included); the others skip that layer's attention and receive
its output, one broadcast of [tokens, hidden] per MLA layer. Sending the cache entries to
the others instead would cost the whole context of every request per layer and step, and a
transient buffer as large as one layer's cache on every rank; the output costs what one
tensor-parallel all-reduce costs, whatever the context.

Owners take contiguous blocks of MLA layers. A shared-indexer layer reuses the selection of
the full layer before it, so it is owned with that layer: the unit of ownership is a full
layer and the shared layers that follow it.

With tensor parallelism too (`tp × ls` ranks), rank r is TP rank r % tp of the Layer Split
rank r // tp; an owner's TP group runs the layer's attention on its heads as usual and each
of its ranks broadcasts the reduced output to the ranks of the same TP position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from oxserve.model.config import TextModelConfig
from oxserve.parallel.tensor import ShardError


@dataclass(frozen=True)
class LayerSplit:
    """This rank's place among `size` ranks that split the MLA layers (`group`: their process
    group, in Layer Split rank order)."""

    rank: int = 0
    size: int = 1
    group: object | None = None

    def owns(self, owner: int | None) -> bool:
        """`owner`: a layer's owner (None: a layer every rank runs, e.g. KDA)."""
        return owner is None or owner == self.rank

    def share(self, x: torch.Tensor, owner: int) -> torch.Tensor:
        """The owner's `x` on every rank (the others pass a buffer of the same shape)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        dist.broadcast(x, group=self.group, group_src=owner)
        return x


WHOLE = LayerSplit()


def layer_owners(cfg: TextModelConfig, size: int) -> list[int | None]:
    """Each decoder layer's owner: None for KDA layers (and for every layer when size is 1);
    for MLA layers the Layer Split rank that stores its cache and runs its attention."""
    owners: list[int | None] = [None] * cfg.num_hidden_layers
    if size == 1:
        return owners
    units: list[list[int]] = []  # a full-indexer layer and the shared layers after it
    for i in cfg.mla_layers:
        if cfg.is_full_indexer_layer(i) or not units:
            units.append([])
        units[-1].append(i)
    if len(units) < size:
        raise ShardError(f"layer_split_size={size} exceeds the model's {len(units)} MLA layer group(s) "
                         "(a full-indexer layer with the shared layers after it)")  # fmt: skip
    # Contiguous blocks balanced by layer count: unit u goes to the rank whose share of the
    # layers it falls in.
    total, seen = sum(map(len, units)), 0
    for unit in units:
        rank = min(size - 1, (seen + len(unit) / 2) * size // total)
        for i in unit:
            owners[i] = int(rank)
        seen += len(unit)
    return owners
