"""Linear layers with oneDNN pre-packed weights, for CPU fp32 (and bf16 where oneDNN has it).

MKL's sgemm (what `F.linear` calls on CPU) handles the few-row products of decode badly:
on the AVX2 EPYC of docs/performance.md, 2-32 rows ran at a third to a half of its one-row
rate. oneDNN reorders the weight once into its blocked layout for an expected row count;
end to end that made decode 9.7% faster per token there (ledger 5, B/A 1.070 [1.017, 1.139]).
This is the weight prepacking that vLLM's and SGLang's CPU backends do through IPEX.

In bf16, `F.linear` already calls oneDNN but reorders the weight on every call: on the
Sapphire Rapids (AMX) machine of docs/performance.md the packed weight took 0.45-0.65x its
time at 1-32 rows (LM head, 8 rows: 2.2 -> 1.4 ms), with bit-equal results.

fp32 results differ from `F.linear` by fp32 rounding only (another summation order).

oneDNN builds and caches a primitive per input shape, so per row count: unbounded row counts
fill its cache (about 1000 entries, 0.6 MiB per row count for the default model's 15 shapes)
and its evictions strand freed memory in the heap (docs/reliability.md#soak). Rows are padded
up to a few buckets (`bucket_rows`: 41 up to 8192 rows), which bounds both; a decode step is
bound by the weight's bytes, so its padded rows cost next to nothing, and a prefill chunk
computes at most a quarter more rows.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from oxserve.kernels.moe import pack_linear, panel_linear, panel_linear_fit, unpack_panels
from oxserve.model.linear import Linear, swap_linears

LINEAR_KERNELS = ("auto", "panels", "onednn", "torch")  # the --linear-kernel choices
PACK_FOR_ROWS = 8  # the row count oneDNN picks its blocking for; decode batches are around it
EXACT_BUCKETS_UP_TO = 16  # powers of two up to here; above, four buckets per doubling


def bucket_rows(rows: int) -> int:
    """The row count a product of `rows` rows (>= 1) runs at: the next power of two up to 16,
    then the next multiple of an eighth of the next power of two (17 -> 20, 33 -> 40)."""
    if rows <= EXACT_BUCKETS_UP_TO:
        return 1 << (rows - 1).bit_length()
    step = 1 << ((rows - 1).bit_length() - 3)
    return -(-rows // step) * step


def onednn_linear_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """CPU fp32; CPU bf16 where oneDNN runs bf16 (AVX-512 or AMX; not on AVX2-only CPUs, where
    bf16 products are emulated)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class OneDNNLinear(nn.Module):
    """A `Linear` whose weight is reordered for oneDNN once the checkpoint has loaded.

    The checkpoint loads into `weight` exactly as for `Linear`; `after_load` packs it and,
    unless another module shares the tensor (a tied LM head), frees the dense copy."""

    def __init__(self, linear: Linear, shared_weight: bool = False):
        super().__init__()
        self.in_features, self.out_parts = linear.in_features, linear.out_parts
        self.out_features = sum(linear.out_parts)
        self.weight = linear.weight
        self.shared_weight = shared_weight
        self.packed: torch.Tensor | None = None

    def after_load(self) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_FOR_ROWS)
        if not self.shared_weight:
            self.weight.data = self.weight.data.new_empty(0)  # the packed copy is the weight now

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            raise RuntimeError("OneDNNLinear used before its weights were loaded")
        rows = x.reshape(-1, self.in_features)
        m = rows.shape[0]
        if m == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        padded = bucket_rows(m)
        rows = F.pad(rows, (0, 0, 0, padded - m)) if padded != m else rows.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, None, "none", [], "")
        return out[:m].view(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        if self.packed is None or self.shared_weight:
            return self.weight
        return self.packed.to_dense()


class PanelLinear(OneDNNLinear):
    """A bf16 `Linear` on packed panels (`oxserve.kernels.moe.panel_linear`, AMX tiles,
    AVX512-BF16 or AVX2 vectors): its weight packed once, one native call a product. oneDNN's
    primitive costs 14-22 us a call whatever the size (Sapphire Rapids; AMD EPYC with
    AVX512-BF16), more than a decode step's small products take on panels (5-11 us;
    `python docs/bench/linear_call_cost.py`); results are bit-equal to
    `F.linear`'s (the same fp32 sums in input order) where torch sums in input order.
    Weights whose inputs are not whole panels (multiples of 32) take oneDNN, or `F.linear`
    where oneDNN has no bf16 (AVX2-only CPUs)."""

    def __init__(self, linear: Linear, shared_weight: bool = False):
        super().__init__(linear, shared_weight)
        self.panels: torch.Tensor | None = None
        self.dense = False  # after_load: neither panels nor oneDNN take this weight; F.linear does

    def after_load(self) -> None:
        weight = self.weight.detach()
        if not panel_linear_fit(weight.device, weight.dtype, self.in_features):
            self.dense = not onednn_linear_supported(weight.device, weight.dtype)
            if not self.dense:
                super().after_load()
            return
        self.panels = pack_linear(weight)
        if not self.shared_weight:
            self.weight.data = self.weight.data.new_empty(0)  # the panels are the weight now

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense:
            return F.linear(x, self.weight)
        if self.panels is None:
            return super().forward(x)
        return panel_linear(x.reshape(-1, self.in_features), self.panels, self.out_features).view(*x.shape[:-1], self.out_features)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """`self(x).float()` in one pass on panels (the LM head's logits)."""
        if self.panels is None:
            return self(x).float()
        rows = x.reshape(-1, self.in_features)
        return panel_linear(rows, self.panels, self.out_features, float_out=True).view(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        if self.panels is None or self.shared_weight:
            return super().dense_weight()
        return unpack_panels(self.panels[None])[0][: self.out_features]


def panel_linear_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return panel_linear_fit(device, dtype, 32)  # CPU, bf16, and a panel build for this CPU


def choose_linear_kernel(
    choice: str, device: torch.device, dtype: torch.dtype
) -> tuple[str, Callable[[nn.Module], object] | None]:
    """('panels', 'onednn' or 'torch', the load transform that installs it) for the
    `linear_kernel` option: auto takes panels where the CPU has AMX-BF16, AVX512-BF16 or
    AVX2 (bf16), else onednn where it is supported."""
    if choice not in LINEAR_KERNELS:
        raise ValueError(f"linear_kernel must be auto, panels, onednn or torch, got {choice!r}")
    if choice == "panels" and not panel_linear_supported(device, dtype):
        raise ValueError(f"linear_kernel panels needs bfloat16 on a CPU with AMX-BF16, AVX512-BF16 or AVX2 "
                         f"(got {device}, {dtype})")
    supported = onednn_linear_supported(device, dtype)
    if choice == "onednn" and not supported:
        raise ValueError(f"linear_kernel onednn needs a CPU device and float32, or bfloat16 on a CPU that oneDNN "
                         f"runs bf16 on (got {device}, {dtype})")
    if choice == "auto":
        choice = "panels" if panel_linear_supported(device, dtype) else "onednn" if supported else "torch"
    install = {"panels": use_panel_linears, "onednn": use_onednn_linears}.get(choice)
    return choice, install


def use_onednn_linears(model: nn.Module) -> int:
    """Swap every `Linear` of `model` (before loading) for a `OneDNNLinear`; returns how many."""
    return _swap_packed(model, OneDNNLinear)


def use_panel_linears(model: nn.Module) -> int:
    """Swap every `Linear` of `model` (before loading) for a `PanelLinear`; returns how many."""
    return _swap_packed(model, PanelLinear)


def _swap_packed(model: nn.Module, kind: type[OneDNNLinear]) -> int:
    names = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return swap_linears(model, lambda name, linear: kind(linear, shared_weight=names[id(linear.weight)] > 1))
