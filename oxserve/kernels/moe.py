"""Routed-expert SwiGLU over tokens already sorted by expert.

    rows:    | e0 e0 e0 | e2 | e3 e3 |        (expert 1 got no tokens)
    offsets: [3, 3, 4, 6]                     (end of each expert's rows)

`grouped_experts` runs all experts in two grouped GEMMs; `looped_experts` is the plain
reference (one GEMM pair per expert) it is tested against, and the fallback where the
grouped GEMM is unavailable (CUDA with fp32). `native_experts` is the CPU bf16 kernel for
the few rows per expert of decode steps (`native/moe_bf16.c`); `panel_experts` the CPU bf16
kernel for any rows, on weights packed at load (`native/bf16_panels.c`), on AMX tiles,
AVX512-BF16 vectors or AVX2 vectors (bf16 widened to fp32), the first the CPU has.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Callable

import torch
import torch.nn.functional as F

from oxserve.kernels import native

log = logging.getLogger(__name__)


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


# Both kernels' arguments: x, P, H, offsets, E, row_weight, gate_up, down, I, limit, y, threads
_EXPERTS_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.moe_bf16_experts.restype = ctypes.c_int
    lib.moe_bf16_experts.argtypes = _EXPERTS_ARGTYPES
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
    hidden, (experts, inter) = rows.shape[1], down.shape[::2]
    if gate_up.shape != (experts, 2 * inter, hidden) or down.shape != (experts, hidden, inter) or offsets.numel() != experts:
        raise ValueError(f"native_experts: weights {tuple(gate_up.shape)}, {tuple(down.shape)} and {offsets.numel()} "
                         f"offsets do not fit rows {tuple(rows.shape)}")
    return _call(lib.moe_bf16_experts, rows, row_weight, offsets, gate_up.contiguous(), down.contiguous(), inter, limit)


def _call(kernel, rows, row_weight, offsets, gate_up, down, inter: int, limit: float) -> torch.Tensor:
    """Run a C expert kernel (either: same arguments) on checked tensors."""
    (p, hidden), experts = rows.shape, offsets.numel()
    rows = rows.contiguous()
    offsets = offsets.to(torch.int32).contiguous()
    row_weight = row_weight.float().reshape(p).contiguous()
    out = torch.empty_like(rows)
    ptr = native.pointer
    status = kernel(ptr(rows), p, hidden, ptr(offsets), experts, ptr(row_weight), ptr(gate_up), ptr(down), inter, limit,
                    ptr(out), torch.get_num_threads())  # fmt: skip
    if status != 0:
        raise MemoryError(f"routed experts: no scratch memory for {p} x {inter} activations")
    return out


# ---- the panel kernels (CPU bf16 on AMX, AVX512-BF16 or AVX2): weights packed once at load -----

PANEL_FLAGS = {  # one source, built for the instructions the CPU has (native/bf16_panels.c)
    "amx": native.NATIVE_ISA + native.OPENMP + ("-O3", "-mamx-tile", "-mamx-bf16"),
    "avx512_bf16": native.NATIVE_ISA + native.OPENMP + ("-O3", "-mno-amx-tile"),  # vectors, also where AMX is
    "avx2": native.NATIVE_ISA + native.OPENMP + ("-O3", "-mno-amx-tile", "-mno-avx512bf16"),  # widened; runs anywhere above
}
# The builds each CPU runs, its own first. The AVX2 build rounds a pair's products apart (see
# bf16_panels.c), so only the first two agree bit for bit.
PANEL_BUILDS = {"amx": ("amx", "avx512_bf16", "avx2"), "avx512_bf16": ("avx512_bf16", "avx2"), "avx2": ("avx2",), None: ()}
PANEL_WIDTH = 16  # output channels per packed panel; inputs go in pairs


def panel_isa() -> str | None:
    """What the panel kernels run on here: 'amx' (tiles), 'avx512_bf16' or 'avx2' (vectors), or None."""
    flags = native.cpu_identity().decode().split()
    if "amx_tile" in flags and "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    return "avx2" if "avx2" in flags and "fma" in flags else None


def panel_builds() -> dict[str, ctypes.CDLL]:
    """Every build of the panel kernels this CPU runs, keyed by instruction set, its own first."""
    isas = PANEL_BUILDS[panel_isa()]
    builds = {isa: native.load("bf16_panels", PANEL_FLAGS[isa]) for isa in isas}
    return {isa: bind_panels(lib) for isa, lib in builds.items() if lib is not None}


def bind_panels(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.panels_enable.restype = ctypes.c_int
    lib.panels_experts.restype = ctypes.c_int
    lib.panels_experts.argtypes = _EXPERTS_ARGTYPES
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.panels_linear.restype = ctypes.c_int
    lib.panels_linear.argtypes = lib.panels_linear_f32.argtypes = [p, i64, i64, i64, p, i64, i64, p, ctypes.c_int]
    lib.panels_linear_f32.restype = ctypes.c_int
    lib.panels_routed.restype = ctypes.c_int
    lib.panels_routed.argtypes = [p, i64, i64, p, p, i64, i64, p, p, i64, ctypes.c_float, p, p, i64, p, ctypes.c_int]
    return lib


@functools.cache
def _panel_kernel() -> ctypes.CDLL | None:
    """The panel kernels built for this CPU (on AMX with the tile state granted by Linux);
    None where the CPU, the compiler or the kernel lacks them."""
    isa = panel_isa()
    lib = native.load("bf16_panels", PANEL_FLAGS[isa]) if isa is not None else None
    if lib is None:
        return None
    lib = bind_panels(lib)
    if lib.panels_enable() != 0:
        log.warning("Linux refused the AMX tile state (arch_prctl): routed experts use the other kernels")
        return None
    return lib


def panel_experts_fit(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int) -> bool:
    """Whether experts of these sizes can be packed for `panel_experts`: CPU bf16 on a CPU with
    AMX-BF16, AVX512-BF16 or AVX2, widths in whole tiles (multiples of 32), a compiler."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and hidden % 32 == 0 and intermediate % 32 == 0
            and _panel_kernel() is not None)  # fmt: skip


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[E, N, K] -> [E, N/16, K/2, 16, 2]: per expert, panels of 16 output channels whose
    inputs are interleaved in pairs, the layout an AMX weight tile loads (native/bf16_panels.c)."""
    e, n, k = weight.shape
    return weight.reshape(e, n // PANEL_WIDTH, PANEL_WIDTH, k // 2, 2).permute(0, 1, 3, 2, 4).contiguous()


def unpack_panels(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_panels`."""
    e, blocks, pairs, panel, two = packed.shape
    return packed.permute(0, 1, 3, 2, 4).reshape(e, blocks * panel, pairs * two)


def panel_experts(
    rows: torch.Tensor, row_weight: torch.Tensor, offsets: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    limit: float, lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """As `native_experts`, on weights packed by `pack_panels` (gate_up from [E, 2I, H], down
    from [E, H, I]). `lib`: another build of the kernel (tests run every build the CPU can)."""
    lib = lib or _panel_kernel()
    if lib is None:
        raise RuntimeError("panel_experts needs a CPU with AMX-BF16, AVX512-BF16 or AVX2 and a C compiler")
    p, hidden = rows.shape
    experts, inter = gate_up.shape[0], down.shape[2] * 2
    if (rows.dtype != torch.bfloat16 or gate_up.dtype != torch.bfloat16 or down.dtype != torch.bfloat16
            or gate_up.shape != (experts, 2 * inter // PANEL_WIDTH, hidden // 2, PANEL_WIDTH, 2)
            or down.shape != (experts, hidden // PANEL_WIDTH, inter // 2, PANEL_WIDTH, 2) or offsets.numel() != experts
            or hidden % 32 or inter % 32):  # fmt: skip
        raise ValueError(f"panel_experts: packed weights {tuple(gate_up.shape)}, {tuple(down.shape)} and {offsets.numel()} "
                         f"offsets do not fit bf16 rows {tuple(rows.shape)} ({rows.dtype})")
    return _call(lib.panels_experts, rows, row_weight, offsets, gate_up, down, inter, limit)


def panel_routed(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`Experts.forward` in one native call on packed weights: x [T, H] bf16, weights [T, k]
    and experts [T, k] (ids 0..E-1) from the router -> [T, H], the sum over each token's
    experts (summed in fp32 in expert order, rounded once, as index_add_ does). `shared`: the
    shared expert's (gate_up, down) panels, whose output is added as `MoE.forward` adds it."""
    (tokens, hidden), (num_experts, inter) = x.shape, (gate_up.shape[0], down.shape[2] * 2)
    rows, ids, weights = x.contiguous(), experts.to(torch.int64).contiguous(), weights.float().contiguous()
    out = torch.empty_like(rows)
    ptr = native.pointer
    shared_gate_up, shared_down = shared if shared is not None else (None, None)
    shared_inter = 0 if shared is None else shared_down.shape[2] * 2
    status = _panel_kernel().panels_routed(
        ptr(rows), tokens, hidden, ptr(ids), ptr(weights), ids.shape[1], num_experts, ptr(gate_up), ptr(down), inter,
        limit, None if shared is None else ptr(shared_gate_up), None if shared is None else ptr(shared_down),
        shared_inter, ptr(out), torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"routed experts: no scratch memory for {ids.numel()} x {inter} activations")
    return out


# ---- plain products on the same panels (`oxserve.kernels.onednn.PanelLinear`) ------------------


def panel_linear_fit(device: torch.device, dtype: torch.dtype, in_features: int) -> bool:
    """Whether a bf16 weight with this many inputs can be packed for `panel_linear`."""
    return device.type == "cpu" and dtype == torch.bfloat16 and in_features % 32 == 0 and _panel_kernel() is not None


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> panels of the weight padded with zero rows to a multiple of 32 outputs."""
    return pack_heads(weight[None])[0]


def pack_heads(weight: torch.Tensor) -> torch.Tensor:
    """[heads, N, K] -> per head, `pack_linear`'s panels (for `panel_heads`)."""
    heads, n, k = weight.shape
    padded = -(-n // (2 * PANEL_WIDTH)) * 2 * PANEL_WIDTH
    return pack_panels(torch.cat([weight, weight.new_zeros(heads, padded - n, k)], dim=1))


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int, lib: ctypes.CDLL | None = None,
                 float_out: bool = False) -> torch.Tensor:
    """x [M, K] bf16 times the weight packed by `pack_linear` -> [M, out_features] bf16 (with
    `float_out`: fp32, the same bf16 values, as `.float()` of it would give). `lib`: as for
    `panel_experts`. (`panel_heads` with one head, without its reshapes: a decode step makes
    ~60 of these calls, so the few microseconds of Python count.)"""
    rows = x if x.is_contiguous() else x.contiguous()
    m, k = rows.shape
    if rows.dtype != torch.bfloat16 or panels.shape[1] * 2 != k:
        raise ValueError(f"panel_linear: rows {tuple(rows.shape)} ({rows.dtype}) do not fit panels {tuple(panels.shape)}")
    lib = lib or _panel_kernel()
    if lib is None:
        raise RuntimeError("panel products need a CPU with AMX-BF16, AVX512-BF16 or AVX2 and a C compiler")
    out = torch.empty(m, out_features, dtype=torch.float32 if float_out else torch.bfloat16)
    if m:
        product = lib.panels_linear_f32 if float_out else lib.panels_linear
        product(rows.data_ptr(), m, 1, k, panels.data_ptr(), out_features, panels.shape[0] * PANEL_WIDTH, out.data_ptr(),
                torch.get_num_threads())
    return out


def panel_heads(x: torch.Tensor, panels: torch.Tensor, out_features: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [M, heads, K] bf16, each head times its own weight [out_features, K] packed by
    `pack_heads` -> [M, heads, out_features] bf16 (`einsum("mhk,hnk->mhn")`, one call)."""
    rows = x.contiguous()
    (m, heads, k), n_packed = rows.shape, panels.shape[1] * PANEL_WIDTH
    if rows.dtype != torch.bfloat16 or panels.shape[0] != heads or panels.shape[2] * 2 != k:
        raise ValueError(f"panel_heads: rows {tuple(rows.shape)} ({rows.dtype}) do not fit panels {tuple(panels.shape)}")
    lib = lib or _panel_kernel()
    if lib is None:
        raise RuntimeError("panel products need a CPU with AMX-BF16, AVX512-BF16 or AVX2 and a C compiler")
    out = rows.new_empty(m, heads, out_features)
    if m:
        lib.panels_linear(native.pointer(rows), m, heads, k, native.pointer(panels), out_features, n_packed,
                          native.pointer(out), torch.get_num_threads())
    return out


# ---- the router (`oxserve.model.moe.Router`) ---------------------------------------------------

ROUTER_MAX_EXPERTS = 1024  # MAX_EXPERTS in moe_router.c


@functools.cache
def _router_kernel() -> ctypes.CDLL | None:
    lib = native.load("moe_router", native.NATIVE_ISA + native.OPENMP + ("-O3",))
    if lib is None:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.moe_route.argtypes = [p, i32, i64, i64, p, p, i64, i64, i64, i64, i32, ctypes.c_float, p, p, p, i32]
    return lib


def native_route_fit(x: torch.Tensor, weight: torch.Tensor, n_group: int) -> bool:
    return (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) and weight.dtype == torch.float32
            and weight.shape[0] <= ROUTER_MAX_EXPERTS and weight.shape[0] % n_group == 0
            and _router_kernel() is not None)


def native_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                 normalise: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`Router.forward` in one call: x [T, H], weight [E, H] fp32 -> (weights [T, k] fp32, ids [T, k])."""
    rows, weight, bias = x.contiguous(), weight.contiguous(), bias.float().contiguous()
    tokens, hidden = rows.shape
    ids = torch.empty(tokens, top_k, dtype=torch.int64)
    weights = torch.empty(tokens, top_k)
    wide = torch.empty(tokens, hidden) if rows.dtype == torch.bfloat16 else weights  # bf16 rows widened there
    ptr = native.pointer
    _router_kernel().moe_route(ptr(rows), int(rows.dtype == torch.bfloat16), tokens, hidden, ptr(weight), ptr(bias),
                               weight.shape[0], n_group, topk_group, top_k, int(normalise), scaling, ptr(ids),
                               ptr(weights), ptr(wide), torch.get_num_threads())
    return weights, ids
