"""The sampler's row-wise work in one native pass per row (`native/sampling.c`): random
sampling (temperature, min-p, top-k, top-p and the inverse CDF of each row's uniform number)
and the repetition, frequency and presence penalties. Their torch forms
(`oxserve.engine.sampler.filtered_probs` then `inverse_cdf`; `penalties_torch`) are what they
are tested against."""

from __future__ import annotations

import array
import ctypes
import functools
import itertools

import torch

from oxserve.kernels import native
from oxserve.sampling_params import SamplingParams

BUILD_FLAGS = native.NATIVE_ISA + native.OPENMP + ("-O3",)


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    lib = native.load("sampling", BUILD_FLAGS)
    if lib is not None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.sample_rows.argtypes = [p, i64, i64, i64, p, p, p, p, p, p, ctypes.c_int]
        lib.sample_rows.restype = ctypes.c_int
        lib.filter_rows.argtypes = [p, i64, i64, i64, p, p, p, p, p, ctypes.c_int]
        lib.filter_rows.restype = ctypes.c_int
        lib.penalise_rows.argtypes = [p, i64, i64, i64, p, p, p, p, p, p, p, ctypes.c_int]
        lib.penalise_rows.restype = ctypes.c_int
    return lib


def sample_fit(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0
            and x.is_contiguous() and _kernel() is not None)  # fmt: skip


def sample_native(x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """One token per row of x [R, V] fp32 (overwritten) under its params, drawn with u [R]
    float64 in [0, 1); -1 for a row holding NaN or +inf, no finite logit or a max that
    overflows when scaled, which is left as it was."""
    (temperature, min_p, top_p), top_k = _filters(params, x.shape[1])
    u = u.to(torch.float64).contiguous()
    out = torch.empty(len(params), dtype=torch.int64)
    ptr = native.pointer
    _check(_kernel().sample_rows(ptr(x), len(params), x.shape[1], x.stride(0), ptr(temperature), ptr(min_p), ptr(top_k),
                                 ptr(top_p), ptr(u), ptr(out), torch.get_num_threads()), x.shape[1])  # fmt: skip
    return out


def filter_native(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each row of x [R, V] fp32 overwritten with the weights that `sample_native` draws from
    (temperature, min-p, top-k, top-p; unnormalised); returns their totals [R] float64, -1 for
    a row it refuses (as `sample_native` does), which is left as it was."""
    (temperature, min_p, top_p), top_k = _filters(params, x.shape[1])
    totals = torch.empty(len(params), dtype=torch.float64)
    ptr = native.pointer
    _check(_kernel().filter_rows(ptr(x), len(params), x.shape[1], x.stride(0), ptr(temperature), ptr(min_p), ptr(top_k),
                                 ptr(top_p), ptr(totals), torch.get_num_threads()), x.shape[1])  # fmt: skip
    return totals


def _filters(params: list[SamplingParams], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: temperature, min-p and top-p ([3, R] float32, as `float32s` takes them) and top-k ([R] int64)."""
    floats = float32s([[p.temperature for p in params], [p.min_p for p in params], [p.top_p for p in params]])
    return floats, torch.tensor([min(p.top_k, vocab) for p in params], dtype=torch.int64)


def _check(status: int, vocab: int) -> None:
    if status == -2:
        raise ValueError(f"sampling: a vocabulary of {vocab} is past the kernel's int32 indices")
    if status != 0:
        raise MemoryError("sampling: no scratch memory")


def float32s(values: list[float] | list[list[float]], device: torch.device | str = "cpu") -> torch.Tensor:
    """[R] (or, from lists of values, [lists, R]) float32; a value past float32's range (a
    finite float64 is accepted) is taken at its edge rather than as infinity, which would turn
    0 * inf and -inf / inf into NaN."""
    limit = torch.finfo(torch.float32).max
    clamped = [[max(-limit, min(limit, v)) for v in row] if isinstance(row, (list, tuple)) else max(-limit, min(limit, row))
               for row in values]  # fmt: skip
    return torch.tensor(clamped, dtype=torch.float32, device=device)


def _flat(token_lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The lists end to end as int64, and where each starts (one more: the end)."""
    starts = [0, *itertools.accumulate(len(tokens) for tokens in token_lists)]
    flat = array.array("q", itertools.chain.from_iterable(token_lists))  # (a C loop: lists of thousands each step)
    ids = torch.frombuffer(flat, dtype=torch.int64) if flat else torch.zeros(1, dtype=torch.int64)  # (no NULL for C)
    return ids, torch.tensor(starts, dtype=torch.int64)


def penalise_native(x: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]]) -> None:
    """The repetition, frequency and presence penalties on x [R, V] fp32 in place, as
    `oxserve.engine.sampler.penalties_torch` computes them: the same floats, except that a
    -0.0 on a token the row has not seen stays -0.0 (the torch form subtracts a negative
    penalty times 0 from every token and makes it +0.0; equal as values)."""
    prompt_ids, prompt_at = _flat(prompts)
    output_ids, output_at = _flat(outputs)
    repetition, frequency, presence = float32s([[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                                                [p.presence_penalty for p in params]])  # fmt: skip
    ptr = native.pointer
    status = _kernel().penalise_rows(ptr(x), len(params), x.shape[1], x.stride(0), ptr(prompt_ids), ptr(prompt_at),
                                     ptr(output_ids), ptr(output_at), ptr(repetition), ptr(frequency), ptr(presence),
                                     torch.get_num_threads())  # fmt: skip
    if status == -2:
        raise IndexError(f"penalties: a prompt or output token id is outside the vocabulary of {x.shape[1]}")
    if status != 0:
        raise MemoryError("penalise_rows: no scratch memory")
