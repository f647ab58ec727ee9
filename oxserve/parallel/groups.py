"""The process groups of a `tp × ls` layout, once the world group is formed.

    rank r  =  ls_rank * tp + tp_rank        (a tensor-parallel group's ranks are adjacent)

    tensor-parallel groups   {s*tp + t : t < tp}   for each Layer Split rank s
    Layer Split groups       {s*tp + t : s < ls}   for each tensor-parallel rank t

Every rank must create every group, in the same order (torch.distributed's rule), even the
groups it is not in.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from oxserve.parallel.layer_split import WHOLE, LayerSplit
from oxserve.parallel.tensor import SINGLE, TensorParallel


@dataclass(frozen=True)
class Placement:
    """Where a rank sits: its piece of every layer (tp) and its share of the MLA layers (ls)."""

    tp: TensorParallel = SINGLE
    ls: LayerSplit = WHOLE

    @property
    def world_size(self) -> int:
        return self.tp.size * self.ls.size


ALONE = Placement()


def form_groups(rank: int, tp_size: int, ls_size: int, timeout: timedelta | None = None,
                expert_parallel: bool = False) -> Placement:  # fmt: skip
    """This rank's placement, with its groups (the world group must already be formed;
    `timeout`: the subgroups' collective timeout, default torch's). `expert_parallel`: the
    tensor-parallel ranks cut the routed experts by expert."""
    if tp_size * ls_size == 1:
        return ALONE
    tp_rank, ls_rank = rank % tp_size, rank // tp_size
    world = dist.group.WORLD
    tp_group = ls_group = world
    if tp_size > 1 and ls_size > 1:
        for s in range(ls_size):
            group = dist.new_group([s * tp_size + t for t in range(tp_size)], timeout=timeout)
            tp_group = group if s == ls_rank else tp_group
        for t in range(tp_size):
            group = dist.new_group([s * tp_size + t for s in range(ls_size)], timeout=timeout)
            ls_group = group if t == tp_rank else ls_group
    tp = TensorParallel(tp_rank, tp_size, tp_group, expert_parallel)
    return Placement(tp, LayerSplit(ls_rank, ls_size, ls_group))
