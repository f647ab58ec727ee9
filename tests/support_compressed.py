"""Test support: a real compressed-tensors W8A8 int8 checkpoint from a glm5_next HF checkpoint.

It writes what llm-compressor writes (and vLLM serves) for the "W8A8" int8 scheme, using the
`compressed-tensors` library itself, so tests of oxserve's pre-quantized loader read the
library's own tensor names and `quantization_config`, not a hand-written imitation:

- weights: int8, symmetric, one scale per output channel (`<module>.weight` int8,
  `<module>.weight_scale` [out, 1]); static, calibrated weight-only with a min-max observer;
- input activations: int8, symmetric, dynamic per token (no calibration, no tensors);
- format "int-quantized"; targets "Linear" minus `ignore`.

Only `nn.Linear` modules are quantized. glm5_next's routed experts are stacked parameters
(`Glm5NextTextExperts.gate_up_proj` / `down_proj`), not Linear modules, so they stay in high
precision; so do the router (`mlp.gate`, a `Glm5NextTextTopkRouter`) and everything else that
is not Linear. An MTP layer in the source is dropped, as transformers does not load it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.offload import update_offload_parameter
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams, is_module_quantized
from transformers import Glm5NextForConditionalGeneration

# As llm-compressor recipes write it: keep the head, the MoE router and the vision tower dense.
DEFAULT_IGNORE = ["re:.*lm_head", "re:.*mlp\\.gate$", "re:.*visual.*"]
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def w8a8_config(ignore: list[str]) -> QuantizationConfig:
    """compressed-tensors' W8A8 int8 scheme (the same as its "W8A8" preset) over Linear."""
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel", dynamic=False),
        input_activations=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True),
    )
    return QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore)


@torch.no_grad()
def _calibrate_weights(model: torch.nn.Module) -> None:
    """Min-max observer over each quantized weight: one (min, max) per output channel."""
    for module in model.modules():
        if not is_module_quantized(module):
            continue
        args = module.quantization_scheme.weights
        weight = module.weight
        scale, zero_point = calculate_qparams(
            weight.amin(dim=-1, keepdim=True), weight.amax(dim=-1, keepdim=True), args
        )
        update_offload_parameter(module, "weight_scale", scale)
        update_offload_parameter(module, "weight_zero_point", zero_point)
        module.quantization_status = QuantizationStatus.FROZEN


def write_w8a8_checkpoint(src: Path, dst: Path, ignore: list[str] | None = None) -> None:
    """Quantize the HF glm5_next checkpoint in `src` to compressed-tensors W8A8 into `dst`."""
    src, dst = Path(src), Path(dst)
    model = Glm5NextForConditionalGeneration.from_pretrained(src, dtype=torch.float32)
    apply_quantization_config(model, w8a8_config(DEFAULT_IGNORE if ignore is None else ignore), show_progress=False)
    _calibrate_weights(model)
    # llm-compressor's save path: compress in memory, save, then add quantization_config.
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="int-quantized")
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    for name in COPIED_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
