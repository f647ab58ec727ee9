"""SmoothQuant: move activation outliers into the weights before quantizing them.

Trained models have a few input channels 20-100x larger than the rest, on every token. A
per-token int8 scale is then set by the outliers and the other channels round to a handful
of levels. For a product X W^T, any per-channel factor s gives the same result

    X W^T = (X diag(1/s)) (W diag(s))^T,      s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)

and with alpha = 0.5 both sides end up with similar ranges per channel (Xiao et al., 2023).
1/s is applied to the activations inside the int8 kernel as they are quantized, so no
neighbouring operator has to absorb it and every quantized module can be smoothed.

Calibration runs the high-precision model (its W8A8 modules `deferred`) over calibration
sequences, recording each module's per-channel input ranges; a module is smoothed only if
its ranges show an outlier channel (a channel above OUTLIER_RATIO times the median).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from oxserve.model.forced import forced_logits
from oxserve.quantization.w8a8 import InputRange, W8A8Experts, W8A8Linear

DEFAULT_ALPHA = 0.5
OUTLIER_RATIO = 8.0  # max channel range / median channel range; Gaussian activations give ~1.5
CALIBRATION_CHUNK = 256


@dataclass(frozen=True)
class SmoothingReport:
    modules: int  # quantized after calibration
    smoothed: list[str]  # the names of those with an outlier channel
    worst_ratio: float  # the largest max/median channel-range ratio seen

    def __str__(self) -> str:
        return f"{len(self.smoothed)} of {self.modules} modules smoothed (largest channel-range ratio {self.worst_ratio:.1f})"


def outlier_ratio(absmax: torch.Tensor) -> float:
    """Over the observed groups (experts) of [G, K] ranges: the largest max/median ratio."""
    seen = absmax[absmax.amax(-1) > 0]
    if seen.numel() == 0:
        return 0.0
    return float((seen.amax(-1) / seen.median(-1).values.clamp(min=1e-12)).max())


def smoothing_factors(inputs: InputRange, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [G, K] for weight [G, N, K]; 1 for groups (experts) calibration never reached."""
    act = inputs.absmax
    w = weight.detach().float().abs().amax(dim=1)
    s = act.clamp(min=1e-5).pow(alpha) / w.clamp(min=1e-5).pow(1 - alpha)
    return torch.where(act.amax(-1, keepdim=True) > 0, s, torch.ones_like(s))


def calibrate_and_quantize(
    model: nn.Module, sequences: list[list[int]], alpha: float = DEFAULT_ALPHA, ratio: float = OUTLIER_RATIO
) -> SmoothingReport:
    """Run `sequences` through the model (deferred W8A8 modules in high precision, recording
    their inputs), then quantize each such module, smoothed where it has outliers; alpha 0
    never smooths."""
    deferred = [(n, m) for n, m in model.named_modules() if isinstance(m, (W8A8Linear, W8A8Experts)) and m.inputs is not None]
    for seq in sequences:
        forced_logits(model, seq, CALIBRATION_CHUNK)
    smoothed, worst = [], 0.0
    for name, module in deferred:
        if isinstance(module, W8A8Linear):
            pairs = [(module.inputs, module.weight[None])]
        else:
            pairs = list(zip(module.inputs, (module.gate_up_proj, module.down_proj), strict=True))
        ratios = [outlier_ratio(inputs.absmax) for inputs, _ in pairs]
        worst = max(worst, *ratios)
        factors = [
            smoothing_factors(inputs, weight, alpha) if alpha > 0 and r > ratio else None
            for (inputs, weight), r in zip(pairs, ratios, strict=True)
        ]
        if any(f is not None for f in factors):
            smoothed.append(name)
        if isinstance(module, W8A8Linear):
            module.quantize(factors[0])
        else:
            module.quantize(*factors)
    return SmoothingReport(len(deferred), smoothed, worst)
