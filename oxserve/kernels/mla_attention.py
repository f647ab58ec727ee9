"""MLA attention over each query's selected positions, on the paged latent cache in place.

`latent_attention` runs `native/mla_attention.c` on CPU for a latent table of the model's
dtype (bf16 or fp32) or an int8/fp8 one (`ScaledRows`: the selected rows dequantized in the
kernel); the torch form (`MLAttention._attend`: gather the selected latents, two products, a
masked softmax) runs elsewhere, and is what the kernel is tested against.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from oxserve.cache.layers import NATIVE_KINDS, ScaledRows
from oxserve.kernels import native

BUILD_FLAGS = native.NATIVE_ISA + native.OPENMP + ("-O3", "-ffp-contract=fast")  # fused multiply-adds


def latent_attention_fit(q_latent: torch.Tensor, latent_table) -> bool:
    """Whether the kernel can run these queries on this table: a plain tensor of q's dtype, or
    int8/fp8 rows read as q's dtype."""
    if q_latent.device.type != "cpu" or q_latent.dtype not in (torch.bfloat16, torch.float32) or _kernel() is None:
        return False
    if isinstance(latent_table, ScaledRows):
        return (latent_table.dtype in NATIVE_KINDS and latent_table.read_as == q_latent.dtype
                and latent_table.values.is_contiguous() and latent_table.scales.is_contiguous())
    return isinstance(latent_table, torch.Tensor) and latent_table.dtype == q_latent.dtype and latent_table.is_contiguous()


def latent_attention(q_latent: torch.Tensor, positions: torch.Tensor, request: torch.Tensor,
                     block_tables: torch.Tensor, block_size: int, latent_table: torch.Tensor | ScaledRows,
                     scale: float) -> torch.Tensor:
    """q_latent [T, H, C]; positions [T, K] (-1: none) of request[t]'s sequence, paged by
    block_tables [R, max_blocks]; latent_table [rows, C] (`latent_attention_fit`). Returns
    [T, H, C] in q's dtype."""
    tokens, heads, dim = q_latent.shape
    q, positions, request = q_latent.contiguous(), positions.contiguous(), request.contiguous()
    block_tables = block_tables.contiguous()
    out = torch.empty_like(q)
    ptr = native.pointer
    if isinstance(latent_table, ScaledRows):
        table, scales, kind = ptr(latent_table.values), ptr(latent_table.scales), NATIVE_KINDS[latent_table.dtype]
    else:
        table, scales, kind = ptr(latent_table), None, 0
    status = _kernel().mla_latent_attention(
        ptr(q), table, scales, kind, ptr(positions), positions.shape[1], ptr(request), ptr(block_tables),
        block_tables.shape[1], block_size, tokens, heads, dim, scale, int(q.dtype == torch.bfloat16), ptr(out),
        torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"mla attention: no scratch memory for {positions.shape[1]} positions x {heads} heads")
    return out


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    lib = native.load("mla_attention", BUILD_FLAGS)
    if lib is None:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.mla_latent_attention.argtypes = [p, p, p, i32, p, i64, p, p, i64, i64, i64, i32, i64, ctypes.c_float, i32, p, i32]
    return lib
