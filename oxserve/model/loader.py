"""Load a Hugging Face glm5_next checkpoint into `Glm5NextForCausalLM`.

Checkpoint names are accepted in both spellings the reference knows: the saved form
(`hc_attn_fn`, `self_attn.f_a_proj`, `q_conv1d`, per-expert `experts.3.gate_proj`) and the
in-memory form (`attn_hc.fn`, `forget_gate.f_a_proj`, `conv1d`, stacked `experts.gate_up_proj`).
Each rule maps a checkpoint tensor onto (part of) one of our parameters; fusions such as
q|k|v or gate|up happen here, at load time, never inside the model.
"""

from __future__ import annotations

import json
import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open

from oxserve.model.config import TextModelConfig
from oxserve.model.glm5_next import Glm5NextForCausalLM

log = logging.getLogger(__name__)

TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: a parameter, and which equal-sized row block of it."""

    param: str
    part: int = 0
    parts: int = 1
    expert: int | None = None  # for stacked expert tensors: write only this expert's slice
    reshape: Callable[[torch.Tensor], torch.Tensor] | None = None


def _conv(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)  # [C, 1, K] -> [C, K]


# (regex over the layer-local name, builder of targets from the match)
_LAYER_RULES: list[tuple[str, Callable[[re.Match], Target]]] = [
    (r"(?:hc_attn_|attn_hc\.)(fn|base|scale)", lambda m: Target(f"attn_hc.{m[1]}")),
    (r"(?:hc_ffn_|ffn_hc\.)(fn|base|scale)", lambda m: Target(f"ffn_hc.{m[1]}")),
    (r"self_attn\.([qkv])_proj\.weight", lambda m: Target("self_attn.qkv_proj.weight", "qkv".index(m[1]), 3)),
    (r"self_attn\.conv1d\.weight", lambda m: Target("self_attn.conv_weight", reshape=_conv)),
    (r"self_attn\.([qkv])_conv1d\.weight", lambda m: Target("self_attn.conv_weight", "qkv".index(m[1]), 3, reshape=_conv)),
    (r"self_attn\.(?:forget_gate\.)?(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)", lambda m: Target(f"self_attn.forget_gate.{m[1]}")),
    (r"self_attn\.o_norm\.weight", lambda m: Target("self_attn.o_norm_weight")),
    (r"self_attn\.indexer\.k_norm\.(weight|bias)", lambda m: Target(f"self_attn.indexer.k_norm_{m[1]}")),
    (r"self_attn\.indexer\.index_kpool_compress_(ape|gate)", lambda m: Target(f"self_attn.indexer.compress_{m[1]}")),
    (r"(mlp(?:\.shared_experts)?)\.(gate|up)_proj\.weight", lambda m: Target(f"{m[1]}.gate_up_proj.weight", ("gate", "up").index(m[2]), 2)),
    (r"mlp\.experts\.(\d+)\.(gate|up)_proj\.weight", lambda m: Target("mlp.experts.gate_up_proj", ("gate", "up").index(m[2]), 2, expert=int(m[1]))),
    (r"mlp\.experts\.(\d+)\.down_proj\.weight", lambda m: Target("mlp.experts.down_proj", expert=int(m[1]))),
    (r"(.+)", lambda m: Target(m[1])),  # same name on both sides
]


class CheckpointError(ValueError):
    pass


@dataclass
class LoadedModel:
    model: Glm5NextForCausalLM
    config: TextModelConfig
    mtp_tensors: dict[str, torch.Tensor]  # layer index num_hidden_layers: for speculative decoding later
    vision_tensors: dict[str, torch.Tensor]


def load_model(path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> LoadedModel:
    path = Path(path)
    cfg = TextModelConfig.from_file(path)
    with _default_dtype(dtype), torch.device(device):
        model = Glm5NextForCausalLM(cfg)
    params = dict(model.named_parameters())
    written = {name: 0 for name in params}
    seen: set[Target] = set()
    mtp: dict[str, torch.Tensor] = {}
    vision: dict[str, torch.Tensor] = {}
    for name, tensor in _iter_tensors(path):
        if name.startswith(VISION_PREFIXES):
            vision[name] = tensor.to(dtype)
            continue
        local = _strip_prefix(name)
        layer = re.match(r"layers\.(\d+)\.(.+)", local)
        if layer and int(layer[1]) >= cfg.num_hidden_layers:
            mtp[local] = tensor.to(dtype)
            continue
        target = _resolve(local, layer)
        if target is None or target.param not in params:
            log.warning("checkpoint tensor %s is not used by oxserve", name)
            continue
        key = Target(target.param, target.part, target.parts, target.expert)
        if key in seen:
            raise CheckpointError(f"tensor {name} duplicates another tensor that fills the same weights")
        seen.add(key)
        written[target.param] += _copy(params[target.param], target, tensor, name)
    if cfg.tie_word_embeddings and not written["lm_head"]:
        params["lm_head"].data.copy_(params["embed_tokens"].data)
        written["lm_head"] = written["embed_tokens"]
    _check_complete(written, params)
    model.eval()
    return LoadedModel(model=model, config=cfg, mtp_tensors=mtp, vision_tensors=vision)


def _resolve(local: str, layer: re.Match | None) -> Target | None:
    if layer is None:
        renamed = {"embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head", "norm.weight": "norm.weight"}
        return Target(renamed[local]) if local in renamed else None
    prefix, rest = f"layers.{layer[1]}.", layer[2]
    for pattern, build in _LAYER_RULES:
        if m := re.fullmatch(pattern, rest):
            t = build(m)
            return Target(prefix + t.param, t.part, t.parts, t.expert, t.reshape)
    return None


def _copy(param: torch.Tensor, target: Target, tensor: torch.Tensor, name: str) -> int:
    """Copy into the target slice; returns how many values were written."""
    if target.reshape is not None:
        tensor = target.reshape(tensor)
    dest = param.data
    if target.expert is not None:
        if not 0 <= target.expert < dest.shape[0]:
            raise CheckpointError(f"tensor {name}: expert {target.expert} out of range (n_routed_experts={dest.shape[0]})")
        dest = dest[target.expert]
    if target.parts > 1:
        rows = dest.shape[0] // target.parts
        dest = dest[target.part * rows : (target.part + 1) * rows]
    if tuple(dest.shape) != tuple(tensor.shape):
        raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(tensor.to(dest.dtype))
    return dest.numel()


def _check_complete(written: dict[str, int], params: dict[str, torch.Tensor]) -> None:
    for name, count in written.items():
        if count != params[name].numel():
            raise CheckpointError(
                f"checkpoint is missing tensor(s) for parameter {name}: "
                f"{count} of {params[name].numel()} values provided"
            )


def _strip_prefix(name: str) -> str:
    if name == "lm_head.weight":
        return name
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors weights in {path}")
    for file in files:
        if not (path / file).exists():
            raise CheckpointError(f"weight shard {file} listed in the index is missing from {path}")
        with safe_open(path / file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
