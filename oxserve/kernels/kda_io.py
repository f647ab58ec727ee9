"""The pointwise math around KDA's delta rule: the gates in front of it and the gated norm after.

    mixed [T, 3HD] --conv, silu--> [q | k | v] --l2norm q (scaled), k--> q, k, v    [T, H, D] fp32
    f (forget-gate projection) --+dt_bias, bounded sigmoid or softplus--> g         [T, H, D] fp32, <= 0
    beta logits --sigmoid--> beta                                                   [T, H] fp32
    core [T, H, D] --rmsnorm * w * sigmoid(gate)--> [T, HD] in the model dtype

`kda_gates` and `gated_norm_torch` are the torch forms (any batch, any device);
`conv_inputs_torch` is the general path's conv and gates. On CPU, `conv_inputs` runs the conv
of any mix of decodes and prompt chunks (the states updated in place in the cache table) and
the gates in one native call, and `gated_norm` the norm in another (`native/kda_io.c`): about
40 eager ops a layer fewer. The torch forms are what they are tested against.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from oxserve.kernels import native
from oxserve.kernels.kda import causal_conv, conv_layout, l2norm

BUILD_FLAGS = native.NATIVE_ISA + native.OPENMP + ("-O3",)
NATIVE_ACTIVATIONS = ("silu", "swish")  # the conv activation the kernel computes
NATIVE_DTYPES = (torch.bfloat16, torch.float32)
NATIVE_MAX_DIM = 1024  # MAX_DIM in kda_io.c


def forget_decay(f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None,
                 dim: int) -> torch.Tensor:
    """Forget-gate projection f [T, H*D] -> per-channel log-decay g [T, H, D] (fp32, <= 0)."""
    g = (f.float() + dt_bias).view(f.shape[0], -1, dim)
    rate = a_log.exp().view(1, -1, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * g)
    return -rate * F.softplus(g, threshold=20.0)


def kda_gates(conv_out: torch.Tensor, f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
              lower_bound: float | None, beta_logits: torch.Tensor, dim: int) -> tuple[torch.Tensor, ...]:
    """conv output [T, 3HD] (after the activation) -> q, k, v, g [T, H, D], beta [T, H], all fp32."""
    tokens = conv_out.shape[0]
    q, k, v = (t.float().view(tokens, -1, dim) for t in conv_out.chunk(3, dim=-1))
    return (l2norm(q) * dim**-0.5, l2norm(k), v, forget_decay(f, dt_bias, a_log, lower_bound, dim),
            torch.sigmoid(beta_logits).float())


def gated_norm_torch(core: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """core [T, H, D] fp32, gate [T, H*D] -> [T, H*D] in gate's dtype."""
    normed = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + eps)
    out = weight.float() * normed * torch.sigmoid(gate.view(core.shape).float())
    return out.to(gate.dtype).flatten(1)


def gated_norm(core: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not (_on_cpu_in(gate.dtype, core, gate) and weight.dtype == gate.dtype and core.dtype == torch.float32
            and core.shape[-1] <= NATIVE_MAX_DIM and _kernel()):
        return gated_norm_torch(core, gate, weight, eps)
    tokens, heads, dim = core.shape
    core, gate, weight = core.contiguous(), gate.contiguous(), weight.contiguous()
    out = gate.new_empty(tokens, heads * dim)
    _kernel().kda_gated_norm(*_ptrs(core, gate, weight), tokens, heads, dim, eps, int(gate.dtype == torch.bfloat16),
                             native.pointer(out), torch.get_num_threads())
    return out


def conv_inputs_fit(mixed: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor, conv_table: torch.Tensor,
                    activation_name: str, dim: int) -> bool:
    """Whether `conv_inputs` can run the conv and gates of these tokens natively."""
    return (activation_name in NATIVE_ACTIVATIONS and dim <= NATIVE_MAX_DIM and isinstance(conv_table, torch.Tensor)
            and conv_table.dtype in NATIVE_DTYPES and conv_table.is_contiguous() and conv_table.device.type == "cpu"
            and f.dtype == beta_logits.dtype == mixed.dtype and _on_cpu_in(mixed.dtype, mixed, f, beta_logits)
            and _kernel() is not None)


def conv_inputs(mixed: torch.Tensor, conv_table: torch.Tensor, slots: torch.Tensor, has_context: torch.Tensor,
                runs: torch.Tensor, conv_taps: torch.Tensor, f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
                lower_bound: float | None, beta_logits: torch.Tensor, dim: int) -> tuple[torch.Tensor, ...]:
    """Decodes and prompt chunks (where `conv_inputs_fit`): mixed [T, 3HD] (the qkv projection),
    request b's tokens rows runs[b] = (first, count) (`model.batch.token_runs`); conv_table [slots,
    K-1, 3HD] updated in place at `slots` [R], a request's state read as zeros unless
    `has_context` [R] (bool); conv_taps [K, 3HD] fp32, the conv weight tap-major (`conv_taps`,
    made once at load); f [T, HD], beta_logits [T, H] in mixed's dtype. Returns q, k, v, g [T,
    H, D] and beta [T, H], fp32, as `conv_inputs_torch` gives them. (A decode step calls this
    once per KDA layer, so the Python around the C call is kept to plain pointers.)"""
    tokens, heads = mixed.shape[0], beta_logits.shape[-1]
    q, k, v, g = (torch.empty(tokens, heads, dim) for _ in range(4))
    beta = torch.empty(tokens, heads)
    mixed, f, beta_logits, slots = (t if t.is_contiguous() else t.contiguous() for t in (mixed, f, beta_logits, slots))
    dt_bias, a_log = (t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous() for t in (dt_bias, a_log))
    status = _kernel().kda_conv_inputs(
        mixed.data_ptr(), conv_table.data_ptr(), slots.data_ptr(), has_context.data_ptr(), runs.data_ptr(),
        conv_taps.data_ptr(), f.data_ptr(), dt_bias.data_ptr(), a_log.data_ptr(), beta_logits.data_ptr(), slots.shape[0],
        heads, dim, conv_taps.shape[0], dim**-0.5, lower_bound is not None, lower_bound or 0.0,
        mixed.dtype == torch.bfloat16, conv_table.dtype == torch.bfloat16, q.data_ptr(), k.data_ptr(), v.data_ptr(),
        g.data_ptr(), beta.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"kda conv: no scratch memory for {tokens} tokens")
    return q, k, v, g, beta


def conv_windows(mixed: torch.Tensor, conv_table: torch.Tensor, slots: torch.Tensor, has_context: torch.Tensor,
                 runs: torch.Tensor, first: int, count: int, widest: int) -> torch.Tensor:
    """For `conv_inputs`'s requests first .. first + count (those verifying drafts), before it
    runs: the conv state after each token of their runs, [count, widest, K-1, 3HD] in the
    table's dtype (a run shorter than `widest` repeats its last), as `kda.conv_windows` stages
    them. `accept_windows` keeps one per request."""
    rows, channels = conv_table.shape[1:]
    windows = torch.empty(count, widest, rows, channels, dtype=conv_table.dtype)
    _kernel().kda_conv_windows(mixed.data_ptr(), conv_table.data_ptr(), slots.data_ptr(), has_context.data_ptr(),
                               runs.data_ptr(), first, count, channels, rows + 1, widest, mixed.dtype == torch.bfloat16,
                               conv_table.dtype == torch.bfloat16, windows.data_ptr())
    return windows


def accept_windows(conv_table: torch.Tensor, slots: torch.Tensor, windows: torch.Tensor, kept: list[int]) -> bool:
    """conv_table[slots[b]] = windows[b, kept[b]] in one native call, where the windows are
    `conv_windows`' (the table's dtype, contiguous); False where they are not (nothing done)."""
    if not (windows.dtype == conv_table.dtype and windows.is_contiguous() and conv_table.is_contiguous()
            and slots.dtype == torch.int64 and slots.is_contiguous() and conv_table.device.type == "cpu"
            and _kernel() is not None):
        return False
    picks = (ctypes.c_int64 * len(kept))(*kept)
    _kernel().kda_conv_accept(conv_table.data_ptr(), slots.data_ptr(), windows.data_ptr(), picks, len(kept),
                              windows.shape[1], windows[0, 0].numel() * windows.element_size())
    return True


def conv_taps(conv_weight: torch.Tensor) -> torch.Tensor:
    """[C, K] -> [K, C] fp32: each tap a contiguous run of channels, as `conv_inputs` reads it."""
    return conv_weight.float().t().contiguous()


def conv_inputs_torch(mixed: torch.Tensor, conv_table: torch.Tensor, slots: torch.Tensor, has_context: torch.Tensor,
                      query_lens: list[int], conv_weight: torch.Tensor, activation, f: torch.Tensor,
                      dt_bias: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None, beta_logits: torch.Tensor,
                      dim: int) -> tuple[torch.Tensor, ...]:
    """`conv_inputs` as the general path computes it: gather the conv states (zeros without
    context), the packed conv, scatter the states back, `kda_gates`."""
    layout = conv_layout(query_lens, conv_weight.shape[1], mixed.device)
    states = conv_table.index_select(0, slots).to(mixed.dtype)
    states = torch.where(has_context.view(-1, 1, 1), states, 0.0)
    conv_out, states = causal_conv(mixed, states, conv_weight, layout, activation)
    conv_table.index_copy_(0, slots, states.to(conv_table.dtype))
    return kda_gates(conv_out, f, dt_bias, a_log, lower_bound, beta_logits, dim)


def _on_cpu_in(dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    """All on CPU, and all in `dtype`, which the kernels take (fp32 tensors aside)."""
    return dtype in NATIVE_DTYPES and all(t.device.type == "cpu" and t.dtype in (dtype, torch.float32) for t in tensors)


def _ptrs(*tensors: torch.Tensor) -> list[ctypes.c_void_p]:
    return [native.pointer(t) for t in tensors]


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    lib = native.load("kda_io", BUILD_FLAGS)
    if lib is None:
        return None
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.kda_conv_inputs.argtypes = [p] * 10 + [i64, i32, i32, i32, f32, i32, f32, i32, i32] + [p] * 5 + [i32]
    lib.kda_gated_norm.argtypes = [p] * 3 + [i64, i32, i32, f32, i32, p, i32]
    lib.kda_conv_windows.argtypes = [p] * 5 + [i64, i64, i64, i32, i64, i32, i32, p]
    lib.kda_conv_windows.restype = None
    lib.kda_conv_accept.argtypes = [p] * 4 + [i64, i64, i64]
    lib.kda_conv_accept.restype = None
    return lib
