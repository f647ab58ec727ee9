"""Projections and parameters that load themselves.

Every projection of the model is a `Linear`; `swap_linears` replaces them all (before the
weights load) with another implementation, which is how quantization and kernel
choices enter without touching the model's maths. A parameter carries its own
`weight_loader(param, tensor, shard) -> values written`, so the checkpoint loader only maps
names to (parameter, `Shard`) and never needs to know how a parameter is stored:

    q_proj.weight -> Shard(part=0) ─┐
    k_proj.weight -> Shard(part=1) ─┼─> qkv_proj.weight rows [0:Q | Q:Q+K | Q+K:Q+K+V]
    v_proj.weight -> Shard(part=2) ─┘

Under tensor parallelism a parameter also carries a `Split` (`param.tp_split`): the loader
cuts each checkpoint tensor to this rank's piece before the parameter's loader sees it, so
every loader (fused, quantized, kernel-packed) works on local shapes only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from oxserve.parallel.tensor import SINGLE, Split, TensorParallel


@dataclass(frozen=True)
class Shard:
    """Which piece of a parameter one checkpoint tensor fills."""

    part: int | None = None  # of the parts fused along the (expert's) row axis; None: all of them
    expert: int | None = None  # of an expert-stacked parameter; None: the whole stack


class CheckpointError(ValueError):
    pass


WeightLoader = Callable[[nn.Parameter, torch.Tensor, Shard], int]


def empty_param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def copy_loader(
    part_rows: tuple[int, ...] | None = None, reshape: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> WeightLoader:
    """Copy a tensor into the part (rows) and expert slice a shard names.

    part_rows: the row count of each fused part (None: the whole parameter is one part)."""

    def load(param: nn.Parameter, tensor: torch.Tensor, shard: Shard) -> int:
        if reshape is not None:
            tensor = reshape(tensor)
        dest = param.data
        if shard.expert is not None:
            if not 0 <= shard.expert < dest.shape[0]:
                raise CheckpointError(f"expert {shard.expert} out of range (n_routed_experts={dest.shape[0]})")
            dest = dest[shard.expert]
        if shard.part is not None:
            if part_rows is None or not 0 <= shard.part < len(part_rows):
                raise CheckpointError(f"part {shard.part} out of range ({len(part_rows or ())} parts)")
            start = sum(part_rows[: shard.part])
            dest = dest[start : start + part_rows[shard.part]]
        if dest.is_floating_point() and not tensor.is_floating_point():
            raise CheckpointError(f"is {tensor.dtype}: a quantized tensor without the weight_scale that would dequantize it")
        if tuple(dest.shape) != tuple(tensor.shape):
            raise CheckpointError(f"has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor.to(dest.dtype))
        return dest.numel()

    return load


def loadable(param: nn.Parameter, loader: WeightLoader | None = None, split: Split | None = None) -> nn.Parameter:
    param.weight_loader = loader or copy_loader()
    param.tp_split = split
    return param


class Linear(nn.Module):
    """y = x W^T, no bias. `out_features` may list the row counts of parts fused into one
    weight at load time (q|k|v, gate|up); the checkpoint fills each part separately.

    Sizes are the full model's. `parallel` says how `tp` ranks share the weight: "column"
    (each holds its share of every part's output rows), "row" (its share of the input
    columns: outputs are partial sums, for `tp.reduce`), "vocab" (output rows rounded up
    among ranks, zero-padded), or None (replicated)."""

    def __init__(self, in_features: int, out_features: int | tuple[int, ...], tp: TensorParallel = SINGLE,
                 parallel: str | None = None):  # fmt: skip
        super().__init__()
        parts = (out_features,) if isinstance(out_features, int) else tuple(out_features)
        split = None
        if parallel == "column":
            parts, split = tuple(tp.local(p, "output features") for p in parts), tp.split(-2, parts)
        elif parallel == "row":
            in_features, split = tp.local(in_features, "input features"), tp.split(-1)
        elif parallel == "vocab":
            parts, split = (tp.vocab_rows(sum(parts)),), tp.split(-2, pad=True)
        elif parallel is not None:
            raise ValueError(f"parallel must be column, row, vocab or None, got {parallel!r}")
        self.in_features = in_features
        self.out_parts = parts
        self.weight = loadable(empty_param(sum(parts), in_features), copy_loader(parts), split)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def dense_weight(self) -> torch.Tensor:
        """W [out, in] in the model's dtype, for maths that uses the weight itself (MLA folds
        kv_b_proj into query and output). Every Linear replacement provides it."""
        return self.weight


def swap_modules(model: nn.Module, kind: type[nn.Module], make: Callable[[str, nn.Module], nn.Module]) -> int:
    """Replace every module of type `kind` in `model` by `make(qualified name, module)`;
    returns how many."""
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, kind)]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, make(name, module))
    return len(targets)


def swap_linears(model: nn.Module, make: Callable[[str, Linear], nn.Module]) -> int:
    """Replace every `Linear` in `model` by `make(qualified name, linear)`; returns how many.
    Call it before loading (`load_model(..., transform=...)`): the new module keeps the
    checkpoint's parameter name (`weight`), and that parameter's `weight_loader` takes each
    part as the checkpoint holds it and stores it however the new module computes; it
    provides `dense_weight()` too."""
    return swap_modules(model, Linear, make)
