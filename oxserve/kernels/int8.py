"""W8A8 arithmetic: symmetric int8 weights (one scale per output channel) times int8
activations (one scale per token, computed per call), accumulated exactly in integers.

    y[m, n] = float(sum_k xq[m, k] wq[n, k]) * sx[m] * sw[n]

With SmoothQuant factors s (per expert and input channel), x is multiplied by 1/s before it
is quantized and the weights were multiplied by s before theirs: the same product, with an
activation outlier channel's range moved into the weights (`oxserve.quantization.smooth`).

`w8a8_grouped` computes it for rows sorted by expert (a plain linear layer is one expert)
with the native kernel (`native/w8a8.c`); `w8a8_grouped_reference` is the plain torch
version it is tested against, bit for bit, and what runs where no C compiler is found.
On this project's AVX2 CPUs `torch._int_mm` runs 15-110x slower than the fp32 product it
would replace (docs/bench/w8a8_matmul.py), so it is not used on CPU.

Where the CPU has AVX2 (or AVX512-VNNI), `w8a8_panels` computes the same integers (so the
same outputs, bit for bit) on weights packed once by `pack_panels` into panels whose vectors
each serve a block of rows: 8 output channels by 2 inputs widened to int16 for `madd_epi16`
on AVX2, 16 by 4 bytes for `vpdpbusd` with AVX512-VNNI (`native/w8a8.c`).
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from oxserve.kernels import native

QMAX = 127  # symmetric: this side never produces -128 (checkpoints may hold it; the kernel takes it)
MAX_K = 2**31 // (128 * 128)  # longest exact int32 sum


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (int8 [..., N, K], fp32 scales [..., N]); each output channel
    (row) gets the scale max|row| / 127 (1 for an all-zero row)."""
    w = weight.float()
    amax = w.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(w / scale[..., None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic quantization, the same arithmetic as the native kernel:
    [M, K] float -> (int8 [M, K], fp32 scales [M])."""
    return quantize_weight(x)


def pad_columns(q: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad the last axis of int8 weights to a multiple of the kernel's step."""
    extra = -q.shape[-1] % multiple
    return F.pad(q, (0, extra)).contiguous() if extra else q.contiguous()


def w8a8_grouped_reference(
    x: torch.Tensor, offsets: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, inv_smooth: torch.Tensor | None = None
) -> torch.Tensor:
    """x [P, K] float sorted by expert; offsets [E] (end of each expert's rows);
    wq [E, N, Kw] int8 with Kw >= K (zero padded); sw [E, N]; inv_smooth None or [E, K]
    -> [P, N] fp32."""
    x = x.float()
    out = x.new_empty(x.shape[0], wq.shape[1], dtype=torch.float32)
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            rows = x[start:end] if inv_smooth is None else x[start:end] * inv_smooth[expert]
            xq, sx = quantize_rows(rows)
            # float64 holds every int32 sum exactly: this is the integer product.
            acc = xq.double() @ wq[expert, :, : x.shape[1]].double().T
            out[start:end] = acc.float() * sx[:, None] * sw[expert][None, :]
        start = end
    return out


BUILD_FLAGS = native.NATIVE_ISA + native.OPENMP + ("-O3",)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.w8a8_grouped.restype = lib.w8a8_panels_grouped.restype = ctypes.c_int
    lib.w8a8_grouped.argtypes = [p, i64, i64, p, i64, p, p, p, i64, i64, p, ctypes.c_int]
    lib.w8a8_panels_grouped.argtypes = [p, i64, i64, p, i64, p, p, p, p, i64, i64, i64, p, ctypes.c_int]
    lib.w8a8_panels_linear.restype = ctypes.c_int
    lib.w8a8_panels_linear.argtypes = [p, ctypes.c_int, i64, i64, p, p, p, p, i64, i64, i64, p, ctypes.c_int, ctypes.c_int]
    lib.w8a8_panels_routed.restype = lib.w8a8_panels_mlp.restype = ctypes.c_int
    lib.w8a8_panels_routed.argtypes = [p, ctypes.c_int, i64, i64, p, p, i64, i64, i64, ctypes.c_float, p, p, p, p, i64, p,
                                       ctypes.c_int]
    lib.w8a8_panels_mlp.argtypes = [p, ctypes.c_int, i64, i64, i64, ctypes.c_float, p, p, p, ctypes.c_int]
    lib.w8a8_panel_width.restype = lib.w8a8_panel_depth.restype = ctypes.c_int
    return lib


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    lib = native.load("w8a8", BUILD_FLAGS)
    return bind(lib) if lib is not None else None


def native_available() -> bool:
    return _kernel() is not None


def column_multiple() -> int:
    """The padding of K that packed weights need (the native kernel's step)."""
    lib = _kernel()
    return lib.w8a8_kstep() if lib is not None else 1


# ---- packed panels (AVX2, AVX512-VNNI) -----------------------------------------------------

MAX_PANEL_K = 65536  # MAX_PANEL_K in w8a8.c: the panels' int32 sums stay exact


@functools.cache
def _layout() -> tuple[int, int] | None:
    """Asked of the kernel once: the products check it on every call, and a captured step
    would otherwise record (and replay) these calls too."""
    lib = _kernel()
    if lib is None or lib.w8a8_panels_available() != 1:
        return None
    return lib.w8a8_panel_width(), lib.w8a8_panel_depth()


def panels_available() -> bool:
    return _layout() is not None


def panel_layout() -> tuple[int, int]:
    """(output channels per panel, inputs per channel in one vector) of this CPU's build: (8, 2)
    on AVX2, (16, 4) with AVX512-VNNI."""
    layout = _layout()
    if layout is None:
        raise RuntimeError("w8a8 panels need a CPU with AVX2 or AVX512-VNNI and a C compiler")
    return layout


def pack_panels(wq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [E, N, K] -> (panels [E, Np/W, Kp/D, W, D], colsum [E, Np] int32) for this CPU's
    `panel_layout()` (W, D): N padded with zero rows to a multiple of 2W, K with zero columns to
    a multiple of D (`native/w8a8.c`)."""
    width, depth = panel_layout()
    e, n, k = wq.shape
    n_pad, k_pad = -(-n // (2 * width)) * 2 * width, -(-k // depth) * depth
    w = F.pad(wq, (0, k_pad - k, 0, n_pad - n))
    panels = w.reshape(e, n_pad // width, width, k_pad // depth, depth).permute(0, 1, 3, 2, 4).contiguous()
    return panels, w.sum(-1, dtype=torch.int32).contiguous()


def unpack_panels(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of `pack_panels`: [E, n, k] int8."""
    e, blocks, steps, width, depth = panels.shape
    return panels.permute(0, 1, 3, 2, 4).reshape(e, blocks * width, steps * depth)[:, :n, :k]


def _padded(panels: torch.Tensor) -> tuple[int, int]:
    """(Np, Kp) of packed panels."""
    return panels.shape[1] * panels.shape[3], panels.shape[2] * panels.shape[4]


def w8a8_panels(x: torch.Tensor, offsets: torch.Tensor, panels: torch.Tensor, colsum: torch.Tensor, sw: torch.Tensor,
                inv_smooth: torch.Tensor | None = None) -> torch.Tensor:
    """As `w8a8_grouped_reference` (bit for bit) on `pack_panels`' weights, where
    `panels_available()`: x [P, K] float sorted by expert, sw [E, N] -> [P, N] fp32."""
    panel_layout()  # a clear error where the CPU has no panels
    x, sw = x.float().contiguous(), sw.float().contiguous()
    offsets = offsets.to(torch.int32).contiguous()
    (experts, n), (p, k) = sw.shape, x.shape
    n_pad, k_pad = _padded(panels)
    if inv_smooth is not None:
        inv_smooth = inv_smooth.float().contiguous()
    if k_pad < k or k_pad > MAX_PANEL_K or offsets.numel() != experts or colsum.shape != (experts, n_pad):
        raise ValueError(f"w8a8: panels {tuple(panels.shape)} / scales {tuple(sw.shape)} do not fit x {tuple(x.shape)}")
    out = torch.empty(p, n, dtype=torch.float32)
    ptr = native.pointer
    status = _kernel().w8a8_panels_grouped(
        ptr(x), p, k, ptr(offsets), experts, ptr(panels), ptr(colsum), ptr(sw),
        None if inv_smooth is None else ptr(inv_smooth), n, n_pad, k_pad, ptr(out), torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"w8a8: no scratch memory for {p} x {k_pad} activations")
    return out


def w8a8_panels_linear(x: torch.Tensor, panels: torch.Tensor, colsum: torch.Tensor, sw: torch.Tensor,
                       inv_smooth: torch.Tensor | None = None) -> torch.Tensor:
    """`w8a8_panels` for one weight (E = 1) on x [M, K] in bf16 or fp32, returning x's dtype:
    the kernel reads and writes the model dtype itself (a decode step makes ~50 of these calls)."""
    rows = x if x.is_contiguous() else x.contiguous()
    (m, k), n = rows.shape, sw.shape[-1]
    n_pad, k_pad = _padded(panels)
    if k_pad < k or rows.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"w8a8: panels {tuple(panels.shape)} do not fit x {tuple(x.shape)} ({x.dtype})")
    out = torch.empty(m, n, dtype=rows.dtype)
    bf16 = rows.dtype == torch.bfloat16
    status = _kernel().w8a8_panels_linear(
        rows.data_ptr(), bf16, m, k, panels.data_ptr(), colsum.data_ptr(), sw.data_ptr(),
        None if inv_smooth is None else inv_smooth.data_ptr(), n, n_pad, k_pad, out.data_ptr(),
        bf16, torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"w8a8: no scratch memory for {m} x {k_pad} activations")
    return out


class PanelStack(ctypes.Structure):
    """One packed weight stack as the routed and MLP entry points read it (`Stack` in
    native/w8a8.c): panels and weight sums from `pack_panels`, scales [E, N] fp32 and
    smoothing factors [E, K] fp32 or None. Built once per module; it keeps the tensors its
    pointers point into."""

    _fields_ = [("panels", ctypes.c_void_p), ("colsum", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("smooth", ctypes.c_void_p), ("n_padded", ctypes.c_int64), ("k_padded", ctypes.c_int64)]

    @classmethod
    def of(cls, panels: torch.Tensor, colsum: torch.Tensor, scale: torch.Tensor,
           smooth: torch.Tensor | None) -> PanelStack:
        tensors = (panels, colsum, scale) + (() if smooth is None else (smooth,))
        if not all(t.is_contiguous() for t in tensors) or scale.dtype != torch.float32 or (
                smooth is not None and smooth.dtype != torch.float32):
            raise ValueError("w8a8: a panel stack needs contiguous tensors and fp32 scales")
        stack = cls(panels.data_ptr(), colsum.data_ptr(), scale.data_ptr(), None if smooth is None else smooth.data_ptr(),
                    *_padded(panels))
        stack.tensors = tensors
        stack.experts, stack.out_features = scale.shape
        return stack


def _mlp_check(status: int, rows: int) -> None:
    if status == -3:
        raise ValueError(f"w8a8: a panel stack wider than {MAX_PANEL_K} inputs")
    if status != 0:
        raise MemoryError(f"w8a8: no scratch memory for {rows} rows")


def w8a8_panels_routed(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: PanelStack,
                       down: PanelStack, limit: float, shared: tuple[PanelStack, PanelStack] | None = None) -> torch.Tensor:
    """The routed experts in one native call (`native/w8a8.c`): x [T, H] (bf16 or fp32), the
    router's weights and expert ids [T, k] -> [T, H] in x's dtype; gate_up packed from [E, 2I, H],
    down from [E, H, I]. The pairs' products are `w8a8_panels`'; the GLU between them is
    computed in fp32 as `clamped_glu` does it, times the routing weight. `shared`: a shared
    expert's stacks (one expert each), its `w8a8_panels_mlp` added as `MoE.forward` adds it."""
    panel_layout()
    rows, ids, weights = x.contiguous(), experts.to(torch.int64).contiguous(), weights.float().contiguous()
    out = torch.empty_like(rows)
    shared_gate_up, shared_down = shared if shared is not None else (None, None)
    status = _kernel().w8a8_panels_routed(
        rows.data_ptr(), int(rows.dtype == torch.bfloat16), rows.shape[0], rows.shape[1], ids.data_ptr(),
        weights.data_ptr(), ids.shape[1], gate_up.experts, gate_up.out_features // 2, limit, ctypes.addressof(gate_up),
        ctypes.addressof(down), None if shared is None else ctypes.addressof(shared_gate_up),
        None if shared is None else ctypes.addressof(shared_down), 0 if shared is None else shared_gate_up.out_features // 2,
        out.data_ptr(), torch.get_num_threads())
    _mlp_check(status, ids.numel())
    return out


def w8a8_panels_mlp(x: torch.Tensor, gate_up: PanelStack, down: PanelStack, limit: float) -> torch.Tensor:
    """A SiLU MLP (a dense layer's, a shared expert's) in one native call: x [T, H] (bf16 or
    fp32) -> [T, H] in x's dtype; gate|up, the clamped GLU in fp32 and down, as one routed
    expert that every row takes at weight 1."""
    panel_layout()
    rows = x.contiguous()
    out = torch.empty_like(rows)
    status = _kernel().w8a8_panels_mlp(
        rows.data_ptr(), int(rows.dtype == torch.bfloat16), rows.shape[0], rows.shape[1], gate_up.out_features // 2, limit,
        ctypes.addressof(gate_up), ctypes.addressof(down), out.data_ptr(), torch.get_num_threads())
    _mlp_check(status, rows.shape[0])
    return out


def w8a8_grouped(
    x: torch.Tensor, offsets: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, inv_smooth: torch.Tensor | None = None,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """As `w8a8_grouped_reference`; wq padded with `pad_columns(..., column_multiple())`.
    `lib`: another build of the kernel (tests build the one without vector instructions)."""
    lib = lib or _kernel()
    if lib is None or x.device.type != "cpu":
        return w8a8_grouped_reference(x, offsets, wq, sw, inv_smooth)
    x, sw = x.float().contiguous(), sw.float().contiguous()
    offsets = offsets.to(torch.int32).contiguous()
    if wq.dtype != torch.int8 or not wq.is_contiguous():
        raise ValueError(f"w8a8: weights must be contiguous int8, got {wq.dtype}")
    (experts, n, kp), (p, k) = wq.shape, x.shape
    if inv_smooth is not None:
        inv_smooth = inv_smooth.float().contiguous()
        if inv_smooth.shape != (experts, k):
            raise ValueError(f"w8a8: smoothing factors {tuple(inv_smooth.shape)} do not fit {experts} x {k}")
    if kp % lib.w8a8_kstep() or kp < k or k > MAX_K or offsets.numel() != experts or sw.shape != (experts, n):
        raise ValueError(f"w8a8: weights {tuple(wq.shape)} / scales {tuple(sw.shape)} do not fit x {tuple(x.shape)}")
    out = torch.empty(p, n, dtype=torch.float32)
    ptr = native.pointer
    smooth = ptr(inv_smooth) if inv_smooth is not None else None
    status = lib.w8a8_grouped(ptr(x), p, k, ptr(offsets), experts, ptr(wq), ptr(sw), smooth, n, kp, ptr(out), torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"w8a8: no scratch memory for {p} x {kp} activations")
    return out
