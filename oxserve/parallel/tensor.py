"""Tensor parallelism: which piece of the model a rank holds, and the collectives that join
the pieces (Megatron's layout, over a torch.distributed process group: gloo on CPU, NCCL on GPU).

    column-parallel  W [out, in] cut by output rows: a rank computes out/size features of the full input
    row-parallel     W [out, in] cut by input columns: a rank's product is a partial sum; `reduce` adds them
    vocab-parallel   embedding and LM head cut by vocabulary rows, rounded up (the last piece zero-padded)
    expert-parallel  (`expert_parallel`) routed experts cut by expert: a rank runs whole experts, the
                     (token, expert) pairs routed to its own, and its sum is a partial sum too

A layer's block (attention or MLP) runs on its heads or intermediate channels alone and ends
in a row-parallel projection, so each block costs one all-reduce; norms, mHC and the router
are replicated. Checkpoint tensors are cut as they load: each parameter carries its `Split`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


class ShardError(ValueError):
    """A checkpoint tensor or a model dimension that does not cut into the ranks' pieces."""


@dataclass(frozen=True)
class Split:
    """The piece of a checkpoint tensor one rank keeps: `axis` (counted from the end, so the
    same for one expert's tensor and a stack of them) cut into `size` equal pieces, piece
    `rank` kept. A tensor holding fused parts whole (`parts`: their full lengths) is cut part
    by part. `pad`: the axis need not divide; pieces round up and the last is zero-padded.
    `experts`: the axis stacks experts, so one expert's own tensor (without that axis) goes
    whole to the rank that holds the expert (`local_expert`)."""

    axis: int
    rank: int
    size: int
    parts: tuple[int, ...] | None = None
    pad: bool = False
    experts: bool = False

    def local_expert(self, expert: int, per_rank: int) -> int | None:
        """Where this rank keeps checkpoint expert `expert` (None: another rank holds it)."""
        if not 0 <= expert < per_rank * self.size:
            raise ShardError(f"names expert {expert}, out of range (n_routed_experts={per_rank * self.size})")
        local = expert - self.rank * per_rank
        return local if 0 <= local < per_rank else None

    def take(self, tensor: torch.Tensor, whole: bool) -> torch.Tensor:
        """`whole`: the tensor holds every fused part (not one of them)."""
        if whole and self.parts is not None and len(self.parts) > 1:
            if tensor.shape[self.axis] != sum(self.parts):
                raise ShardError(f"has {tensor.shape[self.axis]} rows along axis {self.axis}, expected {sum(self.parts)}")
            return torch.cat([self._cut(p) for p in tensor.split(list(self.parts), dim=self.axis)], dim=self.axis)
        return self._cut(tensor)

    def _cut(self, t: torch.Tensor) -> torch.Tensor:
        n = t.shape[self.axis]
        if n % self.size and not self.pad:
            raise ShardError(f"has {n} rows along axis {self.axis}, which do not divide among {self.size} ranks")
        piece = -(-n // self.size)
        start = min(n, self.rank * piece)
        kept = t.narrow(self.axis, start, min(n, start + piece) - start)
        missing = piece - kept.shape[self.axis]
        if missing:
            axis = self.axis % t.dim()
            kept = F.pad(kept, [0, 0] * (t.dim() - 1 - axis) + [0, missing])
        return kept


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place among `size` ranks that split every layer (`group`: their process
    group). `expert_parallel`: routed experts are cut by expert, not within each expert."""

    rank: int = 0
    size: int = 1
    group: object | None = None
    expert_parallel: bool = False

    def local(self, n: int, what: str) -> int:
        """This rank's share of a dimension that must divide evenly (heads, channels)."""
        if n % self.size:
            raise ShardError(f"{what}={n} does not divide by tensor_parallel_size={self.size}")
        return n // self.size

    def vocab_rows(self, vocab_size: int) -> int:
        return -(-vocab_size // self.size)

    def split(self, axis: int, parts: tuple[int, ...] | None = None, pad: bool = False, experts: bool = False) -> Split | None:
        """How this rank cuts a tensor along `axis`; None on a single rank (nothing to cut)."""
        return Split(axis, self.rank, self.size, parts, pad, experts) if self.size > 1 else None

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial `x`, added in fp32 and rounded once (a sum in bf16
        would round at every rank's addition beyond the second)."""
        if self.size == 1:
            return x
        total = x.float().contiguous()
        dist.all_reduce(total, group=self.group)
        return total.to(x.dtype)

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` side by side along the last axis, on the first rank (None elsewhere):
        vocab-parallel logits go only where sampling needs them."""
        if self.size == 1:
            return x
        x = x.contiguous()
        pieces = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, pieces, group=self.group, group_dst=0)
        return torch.cat(pieces, dim=-1) if pieces is not None else None


SINGLE = TensorParallel()
