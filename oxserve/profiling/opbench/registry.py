"""The op registry: op name -> {plain reference, candidate implementations}, and its cases.

A *reference* is written for the check: plain, obviously right, fp64, slow is fine. It takes
the inputs and returns its outputs. A *candidate* is what the engine runs (today the torch
code of `oxserve.model` / `oxserve.kernels`; later Triton or fused variants register here):

    candidate(cfg, inputs) -> run     bind once to the input tensors (build modules, plans)
    run(out)                          compute from the inputs' *current* values into `out`

so the harness can change the inputs' values in place and poison `out` between calls. A
candidate that computes at bind time, or caches by tensor identity, returns stale values.

    register_candidate("kda.recurrent_step", "triton", my_impl)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from oxserve.model.config import TextModelConfig

Inputs = dict[str, torch.Tensor]
Outputs = tuple[torch.Tensor, ...]
# All three take the model config first: shapes and constants (kpool, scale, ...) come from it.
Candidate = Callable[[TextModelConfig, Inputs], Callable[[Outputs], None]]
Reference = Callable[[TextModelConfig, Inputs], Outputs]
# check(cfg, out, reference outputs, inputs) -> None when right, else why not
Check = Callable[[TextModelConfig, Outputs, Outputs, Inputs], "str | None"]


@dataclass(frozen=True)
class BenchShapes:
    """Conditions to bench at: decode batch sizes and context (prompt chunk) lengths."""

    batches: tuple[int, ...] = (1, 16)
    contexts: tuple[int, ...] = (512,)

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 1 or not self.contexts or min(self.contexts) < 1:
            raise ValueError(f"batch sizes and contexts must be >= 1, got {self.batches}, {self.contexts}")


@dataclass(frozen=True)
class Case:
    """One op at one shape."""

    label: str  # "B=16", "L=512", "B=16 ctx=512"
    make_inputs: Callable[[torch.Generator], Inputs]  # fresh random inputs, same shapes every call
    make_outputs: Callable[[Inputs], Outputs]  # uninitialised buffers of the output shapes
    cost: Callable[[Inputs], tuple[float, float]]  # minimum (bytes moved, FLOPs)
    precision: str  # the matmul peak that bounds its FLOPs: "fp32" or "bf16"


@dataclass
class Op:
    name: str
    # (model config, shapes, activation dtype, device) -> the cases to run
    cases: Callable[[TextModelConfig, BenchShapes, torch.dtype, torch.device], list[Case]]
    reference: Reference
    check: Check
    candidates: dict[str, Candidate] = field(default_factory=dict)
    # Inputs that are model weights: the same in every input set of the check, so a candidate
    # may prepare them when it binds, as the engine does at load (a packed layout); the
    # recheck after timing regenerates them with the rest and binds anew.
    weights: tuple[str, ...] = ()


REGISTRY: dict[str, Op] = {}


def register_op(op: Op) -> Op:
    if op.name in REGISTRY:
        raise ValueError(f"op {op.name!r} is already registered")
    REGISTRY[op.name] = op
    return op


def register_candidate(op: str, name: str, candidate: Candidate) -> None:
    if op not in REGISTRY:
        raise KeyError(f"no op {op!r}; known: {', '.join(sorted(REGISTRY))}")
    if name in REGISTRY[op].candidates:
        raise ValueError(f"op {op!r} already has a candidate {name!r}")
    REGISTRY[op].candidates[name] = candidate


def returning(fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]) -> Candidate:
    """A candidate from a plain function of the inputs (by name) that returns its outputs."""
    def bind(cfg: TextModelConfig, inputs: Inputs) -> Callable[[Outputs], None]:
        def run(out: Outputs) -> None:
            result = fn(**inputs)
            for buffer, value in zip(out, result if isinstance(result, tuple) else (result,), strict=True):
                buffer.copy_(value)
        return run
    return bind
