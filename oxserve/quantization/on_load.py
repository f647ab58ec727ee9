"""`--quantization w8a8`: what the engine does before and after loading the weights.

Before: the projections and routed experts become deferred W8A8 modules. After: the model
runs calibration text in high precision, and each module is quantized, smoothed where its
inputs have outlier channels (`smooth`). With alpha 0 modules quantize as they load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from oxserve.quantization.quality import calibration_sequences, shipped_calibration_text
from oxserve.quantization.smooth import calibrate_and_quantize
from oxserve.quantization.w8a8 import quantize_w8a8_on_load

CALIBRATION_SEQUENCES, CALIBRATION_LENGTH = 4, 128


@dataclass(frozen=True)
class QuantizeOnLoad:
    alpha: float  # SmoothQuant migration strength; 0: no calibration, no smoothing

    def transform(self, model: nn.Module) -> int:
        return quantize_w8a8_on_load(model, deferred=self.alpha > 0)

    def finish(self, model: nn.Module, tokenizer) -> str:
        """Calibrate and quantize the deferred modules; a line for the start-up log."""
        if self.alpha == 0:
            return "w8a8 without smoothing"
        text = shipped_calibration_text()
        sequences = calibration_sequences(tokenizer, text, CALIBRATION_SEQUENCES, CALIBRATION_LENGTH)
        report = calibrate_and_quantize(model, sequences, self.alpha)
        return f"w8a8 after calibration on {len(sequences)} x {CALIBRATION_LENGTH} tokens: {report}"


def choose_quantization(choice: str, device: torch.device, alpha: float) -> QuantizeOnLoad | None:
    """What the `quantization` option installs (None for none)."""
    if choice == "none":
        return None
    if choice != "w8a8":
        raise ValueError(f"quantization must be none or w8a8, got {choice!r}")
    if device.type != "cpu":
        raise ValueError(f"quantization w8a8 runs on CPU in this build (its int8 kernel is native C), not {device}")
    return QuantizeOnLoad(alpha)
