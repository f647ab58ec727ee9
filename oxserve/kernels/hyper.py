"""mHC gates: (pre, post, comb) from the projected streams, comb made doubly stochastic.

`hc_gates` runs the native C kernel on CPU fp32 (one call instead of ~120 tiny ops) and
`hc_gates_torch` elsewhere; the torch version is what the kernel is tested against.
"""

from __future__ import annotations

import ctypes

import torch

from oxserve.kernels import native

NATIVE_MAX_N = 16  # MAX_N in hc_gates.c


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
    lib = native.load("hc_gates")
    tokens = mixed.shape[0]
    mixed, base, scale = (t.float().contiguous() for t in (mixed, base, scale))
    pre, post = mixed.new_empty(tokens, n), mixed.new_empty(tokens, n)
    comb = mixed.new_empty(tokens, n, n)
    status = lib.hc_gates(native.pointer(mixed), native.pointer(base), native.pointer(scale), ctypes.c_int64(tokens),
                 ctypes.c_int(n), ctypes.c_int(iters), ctypes.c_float(eps),
                 native.pointer(pre), native.pointer(post), native.pointer(comb))
    if status != 0:
        raise ValueError(f"hc_gates: hc_mult {n} is above the native kernel's limit")
    return pre, post, comb


def hc_gates(
    mixed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if mixed.device.type == "cpu" and n <= NATIVE_MAX_N and native.load("hc_gates") is not None:
        return hc_gates_native(mixed, base, scale, n, iters, eps)
    return hc_gates_torch(mixed, base, scale, n, iters, eps)
