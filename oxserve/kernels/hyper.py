"""mHC hyper-connections' collapse and expand, and their gates.

    streams [T,N,D] --flatten, norm, project--> pre [T,N], post [T,N], comb [T,N,N] (Sinkhorn)
    collapse: block input = sum_n pre_n * stream_n
    expand:   new streams = post (x) block_output + comb^T @ streams

`hc_gates` runs the native C kernel on CPU (one call instead of ~120 tiny ops) and
`hc_gates_torch` elsewhere. On CPU (bf16 or fp32) `hc_collapse` and `hc_expand` each run whole
in one native call, at any batch size; the collapse includes the block's input RMSNorm when
given one. The
torch versions are what the kernels are tested against.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from oxserve.kernels import native
from oxserve.kernels.norm import rms_norm

NATIVE_MAX_N = 16  # MAX_N in hc_gates.c
# `oxserve bench kernels --ops hc.collapse,hc.expand --batch 32,256,512,2048 --threads 2 --dtype
# bfloat16` (N=4, D=256): the native collapse against torch's around the native gates (its
# projection an fp32 GEMM, "native-gates") 50 vs 130 us at 32 tokens, 339 vs 446 at 512, even
# at 2048 (1,960 vs 1,889); the native expand 27 vs 96 us at 32 tokens, 1,138 vs 2,229 at 2048.
BlockNorm = tuple[torch.Tensor, float]  # the RMSNorm after a collapse: (weight, eps)
BUILD_FLAGS = native.NATIVE_ISA + native.OPENMP + ("-O3",)  # vector sums; no FMA contraction under -std=c11


def hc_gates_torch(
    mixed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixed [T, (2+N)N] fp32 -> pre [T, N], post [T, N], comb [T, N, N] (fp32)."""
    pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    # Tokens go last while iterating: reductions over a leading axis of size N vectorise.
    comb = torch.softmax((comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n)).permute(1, 2, 0), dim=1) + eps
    comb = comb / (comb.sum(0, keepdim=True) + eps)  # columns
    for _ in range(iters - 1):
        comb = comb / (comb.sum(1, keepdim=True) + eps)  # rows
        comb = comb / (comb.sum(0, keepdim=True) + eps)  # columns
    return pre, post, comb.permute(2, 0, 1)


def hc_gates_native(
    mixed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lib = _kernel()
    tokens = mixed.shape[0]
    mixed, base, scale = (t.float().contiguous() for t in (mixed, base, scale))
    pre, post = mixed.new_empty(tokens, n), mixed.new_empty(tokens, n)
    comb = mixed.new_empty(tokens, n, n)
    status = lib.hc_gates(native.pointer(mixed), native.pointer(base), native.pointer(scale), ctypes.c_int64(tokens),
                 ctypes.c_int(n), ctypes.c_int(iters), ctypes.c_float(eps),
                 native.pointer(pre), native.pointer(post), native.pointer(comb), torch.get_num_threads())
    if status != 0:
        raise ValueError(f"hc_gates: hc_mult {n} is above the native kernel's limit")
    return pre, post, comb


def hc_gates(
    mixed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if mixed.device.type == "cpu" and n <= NATIVE_MAX_N and _kernel() is not None:
        return hc_gates_native(mixed, base, scale, n, iters, eps)
    return hc_gates_torch(mixed, base, scale, n, iters, eps)


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    lib = native.load("hc_gates", BUILD_FLAGS)
    if lib is not None:  # argument types bound once: a call converts plain ints and floats in C
        p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
        lib.hc_collapse.restype = lib.hc_expand.restype = ctypes.c_int
        lib.hc_collapse.argtypes = [p, i32, i64, i32, i64, p, p, p, i32, f32, f32, p, p, p, p, p, f32, i32]
        lib.hc_expand.argtypes = [p, p, p, p, i32, i64, i32, i64, p, i32]
    return lib


def _native_fits(streams: torch.Tensor, n: int) -> bool:
    return (streams.device.type == "cpu" and streams.dtype in (torch.bfloat16, torch.float32) and n <= NATIVE_MAX_N
            and _kernel() is not None)


# ---- collapse -----------------------------------------------------------------------------


def hc_collapse_torch(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float,
    norm_eps: float, block_norm: BlockNorm | None = None, gates=hc_gates,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T,N,D] -> (post [T,N] fp32, comb [T,N,N] fp32, block input [T,D]); with
    `block_norm` (weight, eps), the block input after the block's RMSNorm."""
    n = streams.shape[1]
    streams_f = streams.float()
    flat = streams_f.flatten(1)
    # rms-normalising a row then projecting = projecting then scaling by the row's 1/rms.
    mean_square = torch.linalg.vector_norm(flat, dim=-1, keepdim=True).square() / flat.shape[1]
    mixed = F.linear(flat, fn.float()) * torch.rsqrt(mean_square + norm_eps)
    pre, post, comb = gates(mixed, base, scale, n, iters, eps)
    collapsed = torch.bmm(pre.unsqueeze(1), streams_f).squeeze(1).to(streams.dtype)
    return post, comb, collapsed if block_norm is None else rms_norm(collapsed, *block_norm)


def hc_collapse_native(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float,
    norm_eps: float, block_norm: BlockNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens, n, d = streams.shape
    streams = streams.contiguous()
    fn, base, scale = (_fp32(t) for t in (fn, base, scale))  # loaded in fp32: no copies
    pre, post = torch.empty(tokens, n, dtype=torch.float32), torch.empty(tokens, n, dtype=torch.float32)
    comb = torch.empty(tokens, n, n, dtype=torch.float32)
    out = streams.new_empty(tokens, d)
    norm_weight, block_eps = (None, 0.0) if block_norm is None else block_norm
    if norm_weight is not None and (norm_weight.dtype != streams.dtype or not norm_weight.is_contiguous()):
        norm_weight = norm_weight.to(streams.dtype).contiguous()
    status = _kernel().hc_collapse(
        streams.data_ptr(), streams.dtype == torch.bfloat16, tokens, n, d, fn.data_ptr(), base.data_ptr(),
        scale.data_ptr(), iters, eps, norm_eps, pre.data_ptr(), post.data_ptr(), comb.data_ptr(), out.data_ptr(),
        None if norm_weight is None else norm_weight.data_ptr(), block_eps, torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"hc_collapse: no scratch memory for {tokens} tokens")
    return post, comb, out


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def hc_collapse(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float,
    norm_eps: float, block_norm: BlockNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    fits = _native_fits(streams, streams.shape[1]) and (block_norm is None or block_norm[0].dtype == streams.dtype)
    kernel = hc_collapse_native if fits else hc_collapse_torch
    return kernel(streams, fn, base, scale, iters, eps, norm_eps, block_norm)


# ---- expand -------------------------------------------------------------------------------


def hc_expand_torch(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ streams


def hc_expand_native(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    tokens, n, d = streams.shape
    post, comb = _fp32(post), _fp32(comb)
    block_out, streams = block_out.to(streams.dtype).contiguous(), streams.contiguous()
    out = torch.empty_like(streams)
    status = _kernel().hc_expand(post.data_ptr(), comb.data_ptr(), block_out.data_ptr(), streams.data_ptr(),
                                 streams.dtype == torch.bfloat16, tokens, n, d, out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise ValueError(f"hc_expand: hc_mult {n} is above the native kernel's limit")
    return out


def hc_expand(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """post [T,N] fp32, comb [T,N,N] fp32, block output [T,D], streams [T,N,D] -> new streams."""
    if _native_fits(streams, streams.shape[1]):
        return hc_expand_native(post, comb, block_out, streams)
    return hc_expand_torch(post, comb, block_out, streams)
