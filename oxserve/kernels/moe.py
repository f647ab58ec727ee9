"""Routed-expert SwiGLU over tokens already sorted by expert.

    rows:    | e0 e0 e0 | e2 | e3 e3 |        (expert 1 got no tokens)
    offsets: [3, 3, 4, 6]                     (end of each expert's rows)

`grouped_experts` runs all experts in two grouped GEMMs; `looped_experts` is the plain
reference (one GEMM pair per expert) it is tested against, and the fallback where the
grouped GEMM is unavailable (CUDA with fp32). `native_experts` is the CPU bf16 kernel for
the few rows per expert of decode steps (`native/moe_bf16.c`).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable

import torch
import torch.nn.functional as F

from oxserve.kernels import native


def clamped_glu(
    gate: torch.Tensor, up: torch.Tensor, limit: float, act: Callable[[torch.Tensor], torch.Tensor] = F.silu
) -> torch.Tensor:
    """act(gate clamped above at limit) * up clamped to [-limit, limit]. The routed experts
    always use SiLU (as the reference does); dense and shared MLPs use the config's act."""
    return act(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def grouped_experts(
    rows: torch.Tensor, row_weight: torch.Tensor, offsets: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float
) -> torch.Tensor:
    """rows [P, H] sorted by expert; row_weight [P, 1] fp32; offsets [E] int32;
    gate_up [E, 2I, H]; down [E, H, I] -> [P, H]. The routing weight scales the (narrower)
    activation rather than the output."""
    gate, up = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    act = (clamped_glu(gate, up, limit) * row_weight).to(rows.dtype)
    return torch._grouped_mm(act, down.transpose(1, 2), offs=offsets)


def looped_experts(
    rows: torch.Tensor, row_weight: torch.Tensor, offsets: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float,
    observe: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """`observe(expert, its rows, its down_proj input)`: sees what each expert multiplies
    (quantization calibration)."""
    out = torch.empty_like(rows)
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            gate, up = F.linear(rows[start:end], gate_up[expert]).chunk(2, dim=-1)
            act = (clamped_glu(gate, up, limit) * row_weight[start:end]).to(rows.dtype)
            if observe is not None:
                observe(expert, rows[start:end], act)
            out[start:end] = F.linear(act, down[expert])
        start = end
    return out


def grouped_gemm_supported(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int) -> bool:
    """torch._grouped_mm needs every operand's rows 16-byte aligned (and bf16 on CUDA)."""
    if not hasattr(torch, "_grouped_mm") or (device.type != "cpu" and dtype != torch.bfloat16):
        return False
    itemsize = torch.empty((), dtype=dtype).element_size()
    return all(width * itemsize % 16 == 0 for width in (hidden, intermediate, 2 * intermediate))


# ---- the native kernel (CPU, bf16, few rows per expert) --------------------------------------

BUILD_FLAGS = native.NATIVE_ISA + native.OPENMP + ("-O3",)
# Up to this many rows per expert on average the native kernel beats the grouped GEMMs; past
# it, oneDNN's blocked GEMMs win (they reuse each loaded weight across many rows).
NATIVE_MAX_ROWS_PER_EXPERT = 6


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.moe_bf16_experts.restype = ctypes.c_int
    lib.moe_bf16_experts.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float,
                                     ctypes.c_void_p, ctypes.c_int]
    return lib


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    lib = native.load("moe_bf16", BUILD_FLAGS)
    return bind(lib) if lib is not None else None


def native_experts_fit(rows: torch.Tensor, num_experts: int) -> bool:
    """Whether `native_experts` takes these rows: CPU bf16, few rows per expert, a compiler."""
    return (rows.device.type == "cpu" and rows.dtype == torch.bfloat16
            and rows.shape[0] <= NATIVE_MAX_ROWS_PER_EXPERT * num_experts and _kernel() is not None)


def native_experts(
    rows: torch.Tensor, row_weight: torch.Tensor, offsets: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    limit: float, lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """As `grouped_experts`, for bf16 on CPU. `lib`: another build of the kernel (tests build
    the ones without AVX-512 or without any vector instructions)."""
    lib = lib or _kernel()
    if lib is None:
        raise RuntimeError("native_experts needs a C compiler (cc / $CC)")
    if rows.dtype != torch.bfloat16 or gate_up.dtype != torch.bfloat16 or down.dtype != torch.bfloat16:
        raise ValueError(f"native_experts takes bf16 rows and weights, got {rows.dtype}, {gate_up.dtype}, {down.dtype}")
    (p, hidden), (experts, inter) = rows.shape, down.shape[::2]
    if gate_up.shape != (experts, 2 * inter, hidden) or down.shape != (experts, hidden, inter) or offsets.numel() != experts:
        raise ValueError(f"native_experts: weights {tuple(gate_up.shape)}, {tuple(down.shape)} and {offsets.numel()} "
                         f"offsets do not fit rows {tuple(rows.shape)}")
    rows, gate_up, down = rows.contiguous(), gate_up.contiguous(), down.contiguous()
    offsets = offsets.to(torch.int32).contiguous()
    row_weight = row_weight.float().reshape(p).contiguous()
    out = torch.empty_like(rows)
    ptr = native.pointer
    status = lib.moe_bf16_experts(ptr(rows), p, hidden, ptr(offsets), experts, ptr(row_weight), ptr(gate_up), ptr(down),
                                  inter, limit, ptr(out), torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"native_experts: no scratch memory for {p} x {inter} activations")
    return out
