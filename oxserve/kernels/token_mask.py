"""Structured outputs' token bitmasks applied to logits, in place.

A bitmask row holds one bit per token (bit t % 32 of int32 word t // 32; 1: allowed), as
llguidance writes it. `apply_token_bitmask` runs the native C kernel on CPU float32 logits
(one pass, whole words at a time) and `apply_token_bitmask_torch` elsewhere; the torch
version is what the kernel is tested against.
"""

from __future__ import annotations

import ctypes

import torch

from oxserve.kernels import native

_BITS = torch.arange(32, dtype=torch.int32)
BUILD_FLAGS = native.OPENMP + ("-O3",)


def apply_token_bitmask_torch(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """logits [B, V]; rows: the R rows to mask; bitmask [R, ceil(V / 32)] int32."""
    vocab = logits.shape[1]
    allowed = ((bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1).flatten(1)[:, :vocab].bool()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))


def apply_token_bitmask_native(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("the native token mask takes CPU float32 logits with unit column stride")
    if bitmask.shape != (len(rows), (logits.shape[1] + 31) // 32) or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not fit {len(rows)} rows of vocabulary {logits.shape[1]}")
    if not all(0 <= r < logits.shape[0] for r in rows):
        raise ValueError(f"rows {rows} are outside the logits' {logits.shape[0]} rows")
    lib = native.load("token_mask", BUILD_FLAGS)
    lib.apply_token_bitmask.restype = None
    index, bitmask = torch.tensor(rows, dtype=torch.int64), bitmask.contiguous()
    lib.apply_token_bitmask(native.pointer(logits), ctypes.c_int64(logits.stride(0)), native.pointer(index),
                            ctypes.c_int64(len(rows)), native.pointer(bitmask), ctypes.c_int64(bitmask.shape[1]),
                            ctypes.c_int64(logits.shape[1]))  # fmt: skip


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    native_ok = logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(1) == 1
    if native_ok and native.load("token_mask", BUILD_FLAGS) is not None:
        apply_token_bitmask_native(logits, rows, bitmask)
    else:
        apply_token_bitmask_torch(logits, rows, bitmask)
