"""Pre-quantized checkpoints in the compressed-tensors format, written by the library itself
(`support_compressed`): what loads as int8, that it computes what the format means, and the
clear errors for schemes oxserve does not run."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from support_compressed import write_w8a8_checkpoint

from oxserve.kernels.int8 import quantize_rows
from oxserve.model.forced import forced_logits
from oxserve.model.linear import CheckpointError, Linear
from oxserve.model.loader import load_model
from oxserve.model.moe import Router
from oxserve.quantization.quality import agreement
from oxserve.quantization.w8a8 import W8A8Experts, W8A8Linear


@pytest.fixture(scope="module")
def compressed_dirs(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("compressed")
    plain, experts = root / "linears", root / "with-experts"
    write_w8a8_checkpoint(tiny_model_dir, plain)
    write_w8a8_checkpoint(tiny_model_dir, experts, quantize_experts=True)
    return plain, experts


def _tokens(vocab: int, length: int = 80) -> list[int]:
    return torch.randint(16, vocab, (length,)).tolist()


def test_int8_modules_hold_the_checkpoints_values(compressed_dirs):
    _, path = compressed_dirs
    model = load_model(path, dtype=torch.float32).model
    tensors = {k.removeprefix("model.language_model."): v for k, v in load_file(path / "model.safetensors").items()}
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, W8A8Linear) and qkv.prequantized
    fused = torch.cat([tensors[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv.packed.qweight[0, :, : qkv.in_features], fused)
    scales = torch.cat([tensors[f"layers.0.self_attn.{p}_proj.weight_scale"] for p in "qkv"]).reshape(-1)
    assert torch.equal(qkv.packed.scale[0], scales.float())
    sparse = next(i for i, t in enumerate(model.config.mlp_layer_types) if t == "sparse")
    experts = model.layers[sparse].mlp.experts
    assert isinstance(experts, W8A8Experts) and experts.prequantized
    up = tensors[f"layers.{sparse}.mlp.experts.1.up_proj.weight"]
    assert torch.equal(experts.gate_up.qweight[1, up.shape[0] :, : up.shape[1]], up)
    assert isinstance(model.lm_head, Linear) and isinstance(model.layers[sparse].mlp.gate, Router)
    assert model.layers[sparse].mlp.gate.weight.dtype == torch.float32


def test_logits_match_the_formats_meaning(compressed_dirs, tiny_model_dir):
    """The oracle is transformers' own model with every quantized Linear's weight replaced by
    the checkpoint's int8 x scale, and its input quantized per token (symmetric, |x|max/127,
    as vLLM does at run time): oxserve's int8 arithmetic agrees with it to rounding (an
    activation landing on the other side of a rounding boundary now and then), far closer
    than either is to the unquantized model."""
    from transformers import Glm5NextForConditionalGeneration

    path, _ = compressed_dirs
    hf = Glm5NextForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    saved = load_file(path / "model.safetensors")
    hooked = 0
    for name, module in hf.named_modules():
        key = next((k for k in _saved_names(name) if k in saved), None)
        if isinstance(module, torch.nn.Linear) and key is not None:
            module.weight.data = saved[key.removesuffix("_scale")].float() * saved[key].float()
            if not name.endswith("kv_b_proj"):  # MLA folds it into other matrices (as vLLM does): no int8 input
                module.register_forward_pre_hook(lambda m, args: (_fake_quant(args[0]),))
            hooked += 1
    assert hooked > 10
    ours = load_model(path, dtype=torch.float32).model
    dense = load_model(tiny_model_dir, dtype=torch.float32).model
    tokens = _tokens(ours.config.vocab_size)
    with torch.no_grad():
        oracle = hf(input_ids=torch.tensor([tokens])).logits[0].float()
    got = forced_logits(ours, tokens, 32)
    to_oracle = agreement([oracle], [got])
    to_dense = agreement([forced_logits(dense, tokens, 32)], [got])
    print(f"compressed-tensors W8A8: vs its oracle {to_oracle}; vs unquantized {to_dense}")
    assert to_oracle.mean_kl < 0.05 * to_dense.mean_kl and to_oracle.top1 == 1.0
    assert to_dense.mean_kl <= 0.01


def _saved_names(module: str) -> list[str]:
    """Where transformers saves a module's weight scale: under its own name, or under the
    checkpoint spelling of the forget gate's projections."""
    return [module + ".weight_scale", module.replace("self_attn.forget_gate.", "self_attn.") + ".weight_scale"]


def _fake_quant(x: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    return (q.float() * scale[:, None]).view_as(x)


def _edit_config(src, dst, edit) -> None:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("edit, named", [
    (lambda q: q.update(quant_method="gptq"), "quant_method 'gptq'"),
    (lambda q: q.update(format="pack-quantized"), "format 'pack-quantized'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=128), "weights.strategy='group'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4), "weights.num_bits=4"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations=None), "weight-only"),
    (lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False), "input_activations.dynamic=False"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(type="float"), "weights.type='float'"),
])
def test_unsupported_schemes_are_named(compressed_dirs, tmp_path, edit, named):
    path, _ = compressed_dirs
    _edit_config(path, tmp_path / "edited", edit)
    with pytest.raises(CheckpointError, match=named.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_model(tmp_path / "edited", dtype=torch.float32)


def _edit_tensor(src, dst, suffix: str, edit) -> None:
    """A copy of checkpoint `src` in `dst` with the tensor named ...`suffix` edited in place:
    `edit(tensors, name)`."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors, next(k for k in tensors if k.endswith(suffix)))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def test_partly_quantized_fused_weight_is_an_error(compressed_dirs, tmp_path):
    def dequantize_k(tensors, name):
        tensors[name] = tensors[name].float() * tensors.pop(name + "_scale").float()

    _edit_tensor(compressed_dirs[0], tmp_path / "broken", "layers.0.self_attn.k_proj.weight", dequantize_k)
    with pytest.raises(CheckpointError, match="k_proj.weight is torch.float32, but the checkpoint quantizes"):
        load_model(tmp_path / "broken", dtype=torch.float32)


def test_quantized_router_is_an_error(compressed_dirs, tmp_path):
    def quantize_router(tensors, name):
        scale = tensors[name].abs().amax(-1, keepdim=True) / 127
        tensors[name], tensors[name + "_scale"] = torch.round(tensors[name] / scale).to(torch.int8), scale

    _edit_tensor(compressed_dirs[0], tmp_path / "router", "mlp.gate.weight", quantize_router)
    with pytest.raises(CheckpointError, match=r"quantizes layers\.\d+\.mlp\.gate \(Router\)"):
        load_model(tmp_path / "router", dtype=torch.float32)
