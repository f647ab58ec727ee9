"""Row-wise decode ops in one native pass each (`native/rows.c`): RMSNorm in bf16, the
greedy argmax, row gathers and scatters of any dtype (embedding lookups, cache stores), the
final norm over the hyper-connection streams, and the MTP layer's input norms and residual
adds. Each has its torch form (`oxserve.kernels.norm.rms_norm_torch`, `torch.Tensor.max`,
`F.embedding`, `index_copy_`, `mean` then RMSNorm, masked_fill and cat, an add then an index),
which runs where the kernel does not fit and is what it is tested against."""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from oxserve.kernels import native

BUILD_FLAGS = native.NATIVE_ISA + native.OPENMP + ("-O3",)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The kernels' argument types, on any build of `native/rows.c` (tests build others)."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rms_norm_bf16.argtypes = [p, i64, i64, p, ctypes.c_float, p, ctypes.c_int]
    lib.argmax_rows.argtypes = [p, i64, i64, i64, p, ctypes.c_int]
    lib.rms_norm_bf16.restype = lib.argmax_rows.restype = None  # void: ctypes would read a stray register
    lib.gather_rows.argtypes = [p, i64, p, i64, i64, i64, p]
    lib.scatter_rows.argtypes = [p, i64, p, i64, i64, p]
    lib.mean_rms_norm_bf16.argtypes = [p, i64, i64, p, i64, i64, p, ctypes.c_float, p]
    lib.mtp_input_norms.argtypes = [p, p, p, i64, i64, p, ctypes.c_float, p, ctypes.c_float, p, ctypes.c_int]
    lib.mtp_input_norms.restype = None
    lib.add_rows_bf16.argtypes = [p, p, i64, p, i64, i64, p]
    lib.scaled_rows_store.argtypes = [p, ctypes.c_int, i64, i64, p, i64, p, p, ctypes.c_int, ctypes.c_int]
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


def rows_fit(table: torch.Tensor, values: torch.Tensor | None = None) -> bool:
    """A contiguous CPU table (and values of its dtype) that the row copies can address."""
    return (table.device.type == "cpu" and table.is_contiguous() and table.dim() >= 1 and not table.is_quantized
            and (values is None or (values.dtype == table.dtype and values.device.type == "cpu"))
            and _kernel() is not None)  # fmt: skip


def _checked(status: int, what: str) -> None:
    if status != 0:
        raise IndexError(f"{what}: an index is out of range")


def repeated_embedding(table: torch.Tensor, ids: torch.Tensor, repeat: int) -> torch.Tensor:
    """F.embedding(ids, table) with each row repeated `repeat` times: [*ids.shape, repeat, D]
    (an embedding lookup straight into the hyper-connection streams), natively on CPU."""
    if rows_fit(table):
        return gather_rows_native(table, ids, repeat)
    return torch.nn.functional.embedding(ids, table).unsqueeze(-2).expand(*ids.shape, repeat, -1).contiguous()


def gather_rows_native(table: torch.Tensor, ids: torch.Tensor, repeat: int = 1) -> torch.Tensor:
    """table[ids] with each row repeated `repeat` times: [*ids.shape, repeat, *row]."""
    ids = ids.to(torch.int64).contiguous()
    out = table.new_empty(*ids.shape, repeat, *table.shape[1:])
    row_bytes = math.prod(table.shape[1:]) * table.element_size()
    _checked(_kernel().gather_rows(native.pointer(table), len(table), native.pointer(ids), ids.numel(), row_bytes, repeat,
                                   native.pointer(out)), "gather_rows")  # fmt: skip
    return out


def scatter_rows_native(table: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """table[rows] = values (distinct rows): `index_copy_` for a cache table."""
    rows, values = rows.to(torch.int64).contiguous(), values.contiguous()
    row_bytes = math.prod(table.shape[1:]) * table.element_size()
    if values.numel() * values.element_size() != rows.numel() * row_bytes:
        raise ValueError(f"scatter_rows: {tuple(values.shape)} values for {rows.numel()} rows of {tuple(table.shape[1:])}")
    _checked(_kernel().scatter_rows(native.pointer(table), len(table), native.pointer(rows), rows.numel(), row_bytes,
                                    native.pointer(values)), "scatter_rows")  # fmt: skip


def scaled_store_fit(values: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> bool:
    """An int8/fp8 table on CPU (contiguous values and scales) and rows of bf16 or fp32 values
    no wider than the kernel's buffer (SCALED_CHUNK in rows.c)."""
    return (values.device.type == "cpu" and values.is_contiguous() and scales.is_contiguous()
            and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32)
            and values.shape[-1] <= 4096 and _kernel() is not None)  # fmt: skip


def scaled_store_native(values: torch.Tensor, scales: torch.Tensor, kind: int, rows: torch.Tensor, x: torch.Tensor) -> None:
    """values[rows], scales[rows] = x quantized (`ScaledRows.store`; `kind`: 1 int8, 2 fp8)."""
    rows, x = rows.to(torch.int64).contiguous().flatten(), x.contiguous()
    if x.numel() != rows.numel() * values.shape[-1]:
        raise ValueError(f"scaled_rows_store: {tuple(x.shape)} values for {rows.numel()} rows of {values.shape[-1]}")
    _checked(_kernel().scaled_rows_store(native.pointer(x), int(x.dtype == torch.bfloat16), rows.numel(), values.shape[-1],
                                         native.pointer(rows), len(values), native.pointer(values), native.pointer(scales),
                                         kind, torch.get_num_threads()), "scaled_rows_store")  # fmt: skip


def add_rows_fit(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor | None = None) -> bool:
    """bf16 rows on CPU, and `rows` (if any) a 1-D tensor of integer row numbers."""
    return (a.device.type == "cpu" and a.dtype == b.dtype == torch.bfloat16 and a.dim() == 2 and a.shape == b.shape
            and b.device.type == "cpu" and _kernel() is not None
            and (rows is None or (rows.dim() == 1 and not rows.dtype.is_floating_point and rows.dtype != torch.bool)))  # fmt: skip


def add_rows_native(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """(a + b)[rows] (all rows without `rows`) for a, b [N, D] bf16: the sum of the rows wanted
    only. Rows are numbers in [0, N): a negative one is an error (torch's index would count it
    from the end)."""
    a, b = a.contiguous(), b.contiguous()
    ids = None if rows is None else rows.to(torch.int64).contiguous()
    n = len(a) if ids is None else ids.numel()
    out = a.new_empty(n, a.shape[1])
    _checked(_kernel().add_rows_bf16(native.pointer(a), native.pointer(b), len(a), None if ids is None else native.pointer(ids),
                                     n, a.shape[1], native.pointer(out)), "add_rows")  # fmt: skip
    return out


def add_rows(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """(a + b)[rows] (a + b without `rows`): natively for bf16 rows on CPU (`add_rows_native`)."""
    if add_rows_fit(a, b, rows):
        return add_rows_native(a, b, rows)
    total = a + b
    return total if rows is None else total[rows]


def mtp_input_norms_native(embeds: torch.Tensor, positions: torch.Tensor, embed_weight: torch.Tensor, embed_eps: float,
                           hidden: torch.Tensor, hidden_weight: torch.Tensor, hidden_eps: float) -> torch.Tensor:
    """[rms_norm(embeds, zeroed at position 0) ; rms_norm(hidden)] -> [T, 2D], all bf16 (`rms_norm_fit` each)."""
    embeds, hidden, positions = embeds.contiguous(), hidden.contiguous(), positions.to(torch.int64).contiguous()
    rows, dim = embeds.shape
    if hidden.shape != embeds.shape or positions.shape != (rows,) or embed_weight.numel() != dim or hidden_weight.numel() != dim:
        raise ValueError(f"MTP input: embeds {tuple(embeds.shape)}, hidden {tuple(hidden.shape)}, positions "
                         f"{tuple(positions.shape)}, norm weights {embed_weight.numel()} and {hidden_weight.numel()}")
    out = embeds.new_empty(rows, 2 * dim)
    _kernel().mtp_input_norms(native.pointer(embeds), native.pointer(hidden), native.pointer(positions), rows, dim,
                              native.pointer(embed_weight.contiguous()), embed_eps, native.pointer(hidden_weight.contiguous()),
                              hidden_eps, native.pointer(out), torch.get_num_threads())  # fmt: skip
    return out


MEAN_NORM_MAX_DIM = 1 << 16  # the kernel keeps a row's mean on its stack


def mean_rms_norm_fit(streams: torch.Tensor, weight: torch.Tensor) -> bool:
    return (streams.device.type == "cpu" and streams.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and streams.dim() == 3 and 0 < streams.shape[2] <= MEAN_NORM_MAX_DIM and weight.numel() == streams.shape[2]
            and _kernel() is not None)  # fmt: skip


def mean_rms_norm_native(streams: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(streams[ids].mean(1)) for streams [T, S, D] bf16 -> [len(ids), D]."""
    streams, ids, weight = streams.contiguous(), ids.to(torch.int64).contiguous(), weight.contiguous()
    tokens, count, dim = streams.shape
    out = streams.new_empty(len(ids), dim)
    _checked(_kernel().mean_rms_norm_bf16(native.pointer(streams), tokens, count, native.pointer(ids), len(ids), dim,
                                          native.pointer(weight), eps, native.pointer(out)), "mean_rms_norm")  # fmt: skip
    return out
