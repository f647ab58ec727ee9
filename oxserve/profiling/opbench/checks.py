"""Helpers shared by the op definitions: output checks, random inputs, module binding."""

from __future__ import annotations

import torch
from torch import nn

from oxserve.profiling.opbench.registry import Check, Inputs, Outputs

# Largest error allowed, relative to the reference's largest magnitude, per activation dtype.
# bf16 keeps 8 mantissa bits (one rounding ~0.4%); fp32 ops differ from fp64 by summation order.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def poison(out: Outputs) -> None:
    """Fill output buffers with values no correct op produces: NaN, or the int minimum."""
    for t in out:
        t.fill_(float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).min)


def close(tolerance: float) -> Check:
    def check(cfg, out: Outputs, ref: Outputs, inputs: Inputs) -> str | None:
        for i, (got, want) in enumerate(zip(out, ref, strict=True)):
            problem = compare(got, want, tolerance)
            if problem:
                return f"output {i}: {problem}"
        return None
    return check


def close_for(input_name: str) -> Check:
    """close() at the tolerance of the dtype of input `input_name` (the activations)."""
    def check(cfg, out: Outputs, ref: Outputs, inputs: Inputs) -> str | None:
        return close(TOLERANCE[inputs[input_name].dtype])(cfg, out, ref, inputs)
    return check


def compare(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> str | None:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if not got.is_floating_point():
        bad = (got != want).sum().item()
        return f"{bad} of {got.numel()} values differ" if bad else None
    got64, want64 = got.double(), want.double()
    unwritten = torch.isnan(got64) & ~torch.isnan(want64)
    if unwritten.any():
        return f"{int(unwritten.sum())} of {got.numel()} values are NaN (not written, or invalid)"
    scale = want64.abs().max().item() or 1.0
    err = (got64 - want64).abs().max().item() / scale
    if not err <= tolerance:
        return f"max error {err:.3g} of the largest magnitude, allowed {tolerance:.3g}"
    return None


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)


def randint(gen: torch.Generator, low: int, high: int, *shape: int, device) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=gen, device=device)


def randperm(gen: torch.Generator, n: int, device) -> torch.Tensor:
    return torch.randperm(n, generator=gen, device=device)


def bind_params(module: nn.Module, **tensors: torch.Tensor) -> nn.Module:
    """Point a module's parameters at input tensors (shared storage, no copy)."""
    for name, tensor in tensors.items():
        setattr(module, name, nn.Parameter(tensor, requires_grad=False))
    return module


def token_counts(shapes) -> list[int]:
    """Token-parallel ops see a decode batch or a prompt chunk as just T tokens."""
    return sorted(set(shapes.batches) | set(shapes.contexts))


def precision_of(dtype: torch.dtype) -> str:
    """The matmul peak that bounds an op computing in `dtype`."""
    return "fp32" if dtype == torch.float32 else "bf16"
