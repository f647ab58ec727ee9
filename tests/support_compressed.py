"""Test support: a real compressed-tensors W8A8 int8 checkpoint from a glm5_next HF checkpoint.

It writes what llm-compressor writes (and vLLM serves) for the "W8A8" int8 scheme, using the
`compressed-tensors` library itself, so tests of oxserve's pre-quantized loader read the
library's own tensor names and `quantization_config`, not a hand-written imitation:

- weights: int8, symmetric, one scale per output channel (`<module>.weight` int8,
  `<module>.weight_scale` [out, 1]); static, calibrated weight-only with a min-max observer;
- input activations: int8, symmetric, dynamic per token (no calibration, no tensors);
- format "int-quantized"; targets "Linear" minus `ignore`.

Only `nn.Linear` modules are quantized by the library. glm5_next's routed experts are stacked
parameters in transformers (`Glm5NextTextExperts`), not Linear modules, so the library leaves
them in high precision. MoE models whose experts are Linear modules (Qwen-MoE, DeepSeek in
vLLM's checkpoints) ship them quantized per expert; `quantize_experts=True` writes that form,
each saved `experts.N.{gate,up,down}_proj.weight` quantized with the library's own
`calculate_qparams` and `quantize` under the same scheme. The router (`mlp.gate`) and
everything else that is not Linear stay in high precision. An MTP layer in the source is
dropped, as transformers does not load it.
"""

from __future__ import annotations

import re
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
from compressed_tensors.quantization.lifecycle.forward import quantize
from compressed_tensors.quantization.utils import calculate_qparams, is_module_quantized
from safetensors.torch import load_file, save_file
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


def write_w8a8_checkpoint(src: Path, dst: Path, ignore: list[str] | None = None, quantize_experts: bool = False) -> None:
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
    if quantize_experts:
        _quantize_expert_tensors(dst, w8a8_config([]).config_groups["group_0"].weights)


@torch.no_grad()
def _quantize_expert_tensors(dst: Path, args: QuantizationArgs) -> None:
    """Each routed expert's saved weight -> int8 `weight` + `weight_scale`, as the library
    writes a Linear (symmetric: no zero point is kept)."""
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        for name in [n for n in tensors if re.search(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$", n)]:
            weight = tensors[name].float()
            scale, zero_point = calculate_qparams(weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True), args)
            tensors[name] = quantize(weight, scale, zero_point, args, dtype=torch.int8)
            tensors[name + "_scale"] = scale
        save_file(tensors, file, metadata={"format": "pt"})
