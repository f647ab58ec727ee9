"""`--quantization w8a8`: what the engine does before and after loading the weights.

Before: the projections and routed experts become deferred W8A8 modules. After: the model
runs calibration text in high precision, and each module is quantized, smoothed where its
inputs have outlier channels (`smooth`). With alpha 0 modules quantize as they load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from oxserve.quantization.plan import QuantizationPlan
from oxserve.quantization.quality import calibration_sequences, shipped_calibration_text
from oxserve.quantization.smooth import calibrate_and_quantize
from oxserve.quantization.w8a8 import quantize_w8a8_on_load

CALIBRATION_SEQUENCES, CALIBRATION_LENGTH = 4, 128


@dataclass(frozen=True)
class QuantizeOnLoad:
    alpha: float  # SmoothQuant migration strength; 0: no calibration, no smoothing
    default: str = "w8a8"  # layers the plan does not name
    plan: QuantizationPlan | None = None

    def quantized(self, layer: int | None) -> bool:
        if layer is None or self.plan is None:
            return self.default == "w8a8"
        return self.plan.weights(layer, self.default) == "w8a8"

    def transform(self, model: nn.Module) -> int:
        return quantize_w8a8_on_load(model, deferred=self.alpha > 0, in_layer=self.quantized)

    def finish(self, model: nn.Module, tokenizer) -> str:
        """Calibrate and quantize the deferred modules; a line for the start-up log."""
        if self.alpha == 0:
            return "w8a8 without smoothing"
        text = shipped_calibration_text()
        sequences = calibration_sequences(tokenizer, text, CALIBRATION_SEQUENCES, CALIBRATION_LENGTH)
        report = calibrate_and_quantize(model, sequences, self.alpha)
        return f"w8a8 after calibration on {len(sequences)} x {CALIBRATION_LENGTH} tokens: {report}"


def choose_quantization(
    choice: str, device: torch.device, alpha: float, plan: QuantizationPlan | None = None
) -> QuantizeOnLoad | None:
    """What the `quantization` option (and a plan's per-layer weights) install; None: nothing."""
    if choice not in ("none", "w8a8"):
        raise ValueError(f"quantization must be none or w8a8, got {choice!r}")
    planned = plan is not None and any(e.get("weights") == "w8a8" for e in plan.layers.values())
    if choice == "none" and not planned:
        return None
    if device.type != "cpu":
        raise ValueError(f"quantization w8a8 runs on CPU in this build (its int8 kernel is native C), not {device}")
    return QuantizeOnLoad(alpha, choice, plan)


def load_transform(quantize: QuantizeOnLoad | None, kernel: Callable[[nn.Module], object] | None) -> Callable[[nn.Module], None]:
    """What the loader applies to the model before its weights: W8A8 first (the linear kernel's
    choice then takes the Linears it leaves), then the kernel's. Every parallel rank uses it."""
    steps = [t for t in (quantize and quantize.transform, kernel) if t is not None]

    def transform(model: nn.Module) -> None:
        for step in steps:
            step(model)

    return transform
