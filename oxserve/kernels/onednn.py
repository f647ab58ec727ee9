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
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch
from torch import nn

from oxserve.model.linear import Linear, swap_linears

PACK_FOR_ROWS = 8  # the row count oneDNN picks its blocking for; decode batches are around it


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
        if rows.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self.packed, None, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        if self.packed is None or self.shared_weight:
            return self.weight
        return self.packed.to_dense()


def choose_linear_kernel(
    choice: str, device: torch.device, dtype: torch.dtype
) -> tuple[str, Callable[[nn.Module], object] | None]:
    """('onednn' or 'torch', the load transform that installs it) for the `linear_kernel`
    option: auto takes onednn where it is supported."""
    if choice not in ("auto", "onednn", "torch"):
        raise ValueError(f"linear_kernel must be auto, onednn or torch, got {choice!r}")
    supported = onednn_linear_supported(device, dtype)
    if choice == "onednn" and not supported:
        raise ValueError(f"linear_kernel onednn needs a CPU device and float32, or bfloat16 on a CPU that oneDNN "
                         f"runs bf16 on (got {device}, {dtype})")
    kernel = "onednn" if choice == "onednn" or (choice == "auto" and supported) else "torch"
    return kernel, use_onednn_linears if kernel == "onednn" else None


def use_onednn_linears(model: nn.Module) -> int:
    """Swap every `Linear` of `model` (before loading) for a `OneDNNLinear`; returns how many."""
    names = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return swap_linears(model, lambda name, linear: OneDNNLinear(linear, shared_weight=names[id(linear.weight)] > 1))
