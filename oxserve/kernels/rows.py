"""Row-wise decode ops in one native pass each (`native/rows.c`): RMSNorm in bf16 and the
greedy argmax. Each has its torch form (`oxserve.kernels.norm.rms_norm_torch`,
`torch.Tensor.max`), which runs where the kernel does not fit and is what it is tested against."""

from __future__ import annotations

import ctypes
import functools

import torch

from oxserve.kernels import native

BUILD_FLAGS = native.NATIVE_ISA + native.OPENMP + ("-O3",)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The kernels' argument types, on any build of `native/rows.c` (tests build others)."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rms_norm_bf16.argtypes = [p, i64, i64, p, ctypes.c_float, p, ctypes.c_int]
    lib.argmax_rows.argtypes = [p, i64, i64, i64, p, ctypes.c_int]
    lib.rms_norm_bf16.restype = lib.argmax_rows.restype = None  # void: ctypes would read a stray register
    return lib


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    lib = native.load("rows", BUILD_FLAGS)
    return bind(lib) if lib is not None else None


def rms_norm_fit(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and x.numel() > 0 and _kernel() is not None)  # fmt: skip


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As `rms_norm_torch` for bf16 x and weight on CPU, within fp32 summation order."""
    rows = x.contiguous()
    out = torch.empty_like(rows)
    dim = rows.shape[-1]
    weight = weight.contiguous()
    _kernel().rms_norm_bf16(native.pointer(rows), rows.numel() // dim, dim, native.pointer(weight), eps,
                            native.pointer(out), torch.get_num_threads())
    return out


def argmax_fit(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0
            and x.stride(1) == 1 and _kernel() is not None)  # fmt: skip


def argmax_native(x: torch.Tensor) -> torch.Tensor:
    """x [R, N] fp32 -> [R] int64: each row's first largest index (a NaN counts as largest)."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        _kernel().argmax_rows(native.pointer(x), x.shape[0], x.shape[1], x.stride(0), native.pointer(out),
                              torch.get_num_threads())
    return out
