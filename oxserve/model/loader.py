"""Load a Hugging Face glm5_next checkpoint into `Glm5NextForCausalLM`.

Checkpoint names are accepted in both spellings the reference knows: the saved form
(`hc_attn_fn`, `self_attn.f_a_proj`, `q_conv1d`, per-expert `experts.3.gate_proj`) and the
in-memory form (`attn_hc.fn`, `forget_gate.f_a_proj`, `conv1d`, stacked `experts.gate_up_proj`).
Each rule maps a checkpoint tensor to one of our parameters and the `Shard` of it that the
tensor fills; the parameter's own `weight_loader` writes it (fusing q|k|v or gate|up, or
later quantizing or sharding it), so this file knows names, not storage. Under tensor
parallelism a parameter's `Split` first cuts the tensor to this rank's piece. After loading,
every module with an `after_load()` hook gets it.

The MTP layer (index num_hidden_layers) loads only when asked for; the vision tower is a
separate module (`load_vision_tower`), loaded only for servers that take images.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open

from oxserve.model.config import TextModelConfig
from oxserve.model.glm5_next import Glm5NextForCausalLM
from oxserve.model.linear import CheckpointError, Shard, copy_loader
from oxserve.model.vision import MultiModalConfig, VisionTower
from oxserve.parallel.layer_split import WHOLE, LayerSplit
from oxserve.parallel.tensor import SINGLE, ShardError, Split, TensorParallel
from oxserve.quantization.scheme import read_scheme
from oxserve.quantization.w8a8 import use_prequantized_w8a8

log = logging.getLogger(__name__)

TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")

__all__ = ["CheckpointError", "LoadedModel", "load_model", "load_vision_tower"]


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: a parameter, and which shard of it."""

    param: str
    shard: Shard = Shard()


def _part(name: str, names: str | tuple[str, ...]) -> Shard:
    return Shard(part=names.index(name))



# Rules for the names inside a decoder (or MTP) layer: regex -> target builder.
_LAYER_RULES: list[tuple[str, Callable[[re.Match], Target]]] = [
    (r"(?:hc_attn_|attn_hc\.)(fn|base|scale)", lambda m: Target(f"attn_hc.{m[1]}")),
    (r"(?:hc_ffn_|ffn_hc\.)(fn|base|scale)", lambda m: Target(f"ffn_hc.{m[1]}")),
    (r"self_attn\.([qkv])_proj\.weight", lambda m: Target("self_attn.qkv_proj.weight", _part(m[1], "qkv"))),
    (r"self_attn\.conv1d\.weight", lambda m: Target("self_attn.conv_weight")),
    (r"self_attn\.([qkv])_conv1d\.weight", lambda m: Target("self_attn.conv_weight", _part(m[1], "qkv"))),
    (r"self_attn\.(?:forget_gate\.)?(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)", lambda m: Target(f"self_attn.forget_gate.{m[1]}")),
    (r"self_attn\.o_norm\.weight", lambda m: Target("self_attn.o_norm_weight")),
    (r"self_attn\.indexer\.k_norm\.(weight|bias)", lambda m: Target(f"self_attn.indexer.k_norm_{m[1]}")),
    (r"self_attn\.indexer\.index_kpool_compress_(ape|gate)", lambda m: Target(f"self_attn.indexer.compress_{m[1]}")),
    (r"(mlp(?:\.shared_experts)?)\.(gate|up)_proj\.weight", lambda m: Target(f"{m[1]}.gate_up_proj.weight", _part(m[2], ("gate", "up")))),
    (r"mlp\.experts\.(\d+)\.(gate|up)_proj\.weight", lambda m: Target("mlp.experts.gate_up_proj", Shard(("gate", "up").index(m[2]), int(m[1])))),
    (r"mlp\.experts\.(\d+)\.down_proj\.weight", lambda m: Target("mlp.experts.down_proj", Shard(expert=int(m[1])))),
    (r"shared_head\.norm\.weight", lambda m: Target("shared_head_norm.weight")),
    (r"(.+)", lambda m: Target(m[1])),  # same name on both sides
]
# The MTP layer shares the model's embedding and head; checkpoints may carry copies.
_MTP_SHARED = re.compile(r"(shared_head\.head|embed_tokens)\.weight")


class CheckpointLoad:
    """Counts what each parameter received, so a missing or doubled tensor is an error."""

    def __init__(self, model: Glm5NextForCausalLM, splits: dict[str, Split]):
        """`splits`: tensor parallelism's cut of each parameter (by name) that has one."""
        self.params = dict(model.named_parameters())
        self.splits = splits
        self.written = {name: 0 for name in self.params}
        self.seen: set[Target] = set()

    def load(self, target: Target, tensor: torch.Tensor, name: str) -> bool:
        param = self.params.get(target.param)
        if param is None:
            return False
        if target in self.seen:
            raise CheckpointError(f"tensor {name} duplicates another tensor that fills the same weights")
        self.seen.add(target)
        loader = getattr(param, "weight_loader", None) or copy_loader()
        shard = target.shard
        try:
            if (split := self.splits.get(target.param)) is not None and split.experts and shard.expert is not None:
                local = split.local_expert(shard.expert, param.shape[0])
                if local is None:
                    return True  # another expert-parallel rank's expert
                shard = replace(shard, expert=local)
            elif split is not None:
                tensor = split.take(tensor, whole=shard.part is None)
            self.written[target.param] += loader(param, tensor, shard)
        except (CheckpointError, ShardError) as e:
            raise CheckpointError(f"tensor {name} {e}") from None
        return True

    def check_complete(self) -> None:
        for name, count in self.written.items():
            if count != self.params[name].numel():
                raise CheckpointError(
                    f"checkpoint is missing tensor(s) for parameter {name}: "
                    f"{count} of {self.params[name].numel()} values provided"
                )


@dataclass
class LoadedModel:
    model: Glm5NextForCausalLM
    config: TextModelConfig


def _scale_splits(model: torch.nn.Module, splits: dict[str, Split]) -> dict[str, Split]:
    """A pre-quantized weight's per-row scales are cut as its rows or experts are, and not
    where its inputs are: each row's scale covers the whole row."""
    params = dict(model.named_parameters())
    return {f"{name}_scale": split for name, split in splits.items()
            if f"{name}_scale" in params and split.axis % params[name].dim() != params[name].dim() - 1}  # fmt: skip


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    with_mtp: bool = False,
    transform: Callable[[Glm5NextForCausalLM], object] | None = None,
    tp: TensorParallel = SINGLE,
    ls: LayerSplit = WHOLE,
) -> LoadedModel:
    """`transform` runs on the built model before any weight is read: the place to swap in
    other Linears (`swap_linears`) whose parameters then load the checkpoint themselves.
    A pre-quantized checkpoint (compressed-tensors W8A8) gets its int8 modules first.
    `tp`: load this rank's piece of a tensor-parallel model; `ls`: its share of the MLA
    layers under Layer Split (every rank loads every layer)."""
    path = Path(path)
    cfg = TextModelConfig.from_file(path)
    prequantized = read_scheme(json.loads((path / "config.json").read_text()))
    if with_mtp and not any(_is_mtp_tensor(_strip_prefix(name), cfg) for name in _tensor_names(path)):
        raise CheckpointError(f"{path} has no MTP layer (layer {cfg.num_hidden_layers}'s tensors): "
                              "MTP speculative decoding needs one; the ngram method does not")
    with _default_dtype(dtype), torch.device(device):
        model = Glm5NextForCausalLM(cfg, with_mtp=with_mtp, tp=tp, ls=ls)
        # Collected before any transform: a swapped-in module keeps its parameters' names.
        splits = {name: p.tp_split for name, p in model.named_parameters() if getattr(p, "tp_split", None) is not None}
        if prequantized:
            use_prequantized_w8a8(model, _quantized_modules(path, cfg, with_mtp))
            splits |= _scale_splits(model, splits)
        if transform is not None:
            transform(model)
    load = CheckpointLoad(model, splits)
    for name, read in _checkpoint(path):
        if name.startswith(VISION_PREFIXES):
            continue
        if name.endswith(ZERO_POINT):
            _check_symmetric(name, read())
            continue
        target = _target(_strip_prefix(name), cfg, with_mtp)
        if target is SKIP:
            continue
        if target is None or not load.load(target, read(), name):
            log.warning("checkpoint tensor %s is not used by oxserve", name)
    load.check_complete()
    for module in reversed(list(model.modules())):  # children first: MLA folds its finished kv_b_proj
        if hasattr(module, "after_load"):
            module.after_load()
    model.eval()
    return LoadedModel(model=model, config=cfg)


def load_vision_tower(path: str | Path, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu") -> VisionTower | None:  # fmt: skip
    """The checkpoint's vision tower and projector (None: a text-only checkpoint). Its
    parameter names are the checkpoint's, so every tensor must match one exactly."""
    path = Path(path)
    mm = MultiModalConfig.from_file(path)
    if mm is None:
        return None
    with _default_dtype(dtype), torch.device(device):
        tower = VisionTower(mm.vision)
    params = dict(tower.named_parameters())
    loaded = set()
    for name, read in _checkpoint(path):
        prefix = next((p for p in VISION_PREFIXES if name.startswith(p)), None)
        if prefix is None:
            continue
        local = name[len(prefix) :]
        if local not in params:
            raise CheckpointError(f"checkpoint tensor {name} has no place in the vision tower")
        tensor = read()
        if tensor.shape != params[local].shape:
            raise CheckpointError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}; "
                                  f"the vision config makes it {tuple(params[local].shape)}")  # fmt: skip
        with torch.no_grad():
            params[local].copy_(tensor)
        loaded.add(local)
    if missing := sorted(set(params) - loaded):
        raise CheckpointError(f"the checkpoint lacks vision tensors: {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))  # fmt: skip
    return tower.eval()


SKIP = Target("")  # a tensor deliberately not read (the MTP layer unless asked for)
SCALE = "_scale"  # compressed-tensors: `<module>.weight_scale` holds the int8 weight's scales
ZERO_POINT = "_zero_point"


def _target(local: str, cfg: TextModelConfig, with_mtp: bool) -> Target | None:
    """Where a checkpoint tensor (name without its text-model prefix) goes; None: nowhere."""
    if local.endswith(".weight" + SCALE):
        base = _target(local[: -len(SCALE)], cfg, with_mtp)
        return base if base in (None, SKIP) else Target(base.param + SCALE, base.shard)
    layer = re.match(r"layers\.(\d+)\.(.+)", local)
    mtp_index = cfg.num_hidden_layers
    if layer and int(layer[1]) >= mtp_index:
        if not with_mtp or int(layer[1]) != mtp_index or _MTP_SHARED.fullmatch(layer[2]):
            return SKIP  # not read: the MTP layer costs nothing unless a drafter needs it
        return _layer_target("mtp.", layer[2])
    if layer:
        return _layer_target(f"layers.{layer[1]}.", layer[2])
    return _top_target(local, cfg)


def _is_mtp_tensor(local: str, cfg: TextModelConfig) -> bool:
    return local.startswith(f"layers.{cfg.num_hidden_layers}.")


def _quantized_modules(path: Path, cfg: TextModelConfig, with_mtp: bool) -> set[str]:
    """Our modules whose weights the checkpoint holds in int8 (it has their weight_scale)."""
    modules = set()
    for name in _tensor_names(path):
        if name.endswith(".weight" + SCALE) and not name.startswith(VISION_PREFIXES):
            target = _target(_strip_prefix(name), cfg, with_mtp)
            if target not in (None, SKIP):
                modules.add(target.param[: -len(SCALE)].rpartition(".")[0])
    return modules


def _check_symmetric(name: str, zero_point: torch.Tensor) -> None:
    if zero_point.any():
        raise CheckpointError(f"tensor {name} has non-zero zero points: asymmetric quantization is not supported")


def _top_target(local: str, cfg: TextModelConfig) -> Target | None:
    if local == "lm_head.weight" and cfg.tie_word_embeddings:
        return None  # tied: the embedding is the head
    renamed = {"embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head.weight", "norm.weight": "norm.weight"}
    return Target(renamed[local]) if local in renamed else None


def _layer_target(prefix: str, rest: str) -> Target:
    for pattern, build in _LAYER_RULES:
        if m := re.fullmatch(pattern, rest):
            t = build(m)
            return Target(prefix + t.param, t.shard)
    raise AssertionError("the last rule matches every name")


def _strip_prefix(name: str) -> str:
    if name == "lm_head.weight":
        return name
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _shards(path: Path) -> list[str]:
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
    return files


def _tensor_names(path: Path) -> Iterator[str]:
    for file in _shards(path):
        with safe_open(path / file, framework="pt") as f:
            yield from f.keys()


def _checkpoint(path: Path) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(name, read) for every tensor; `read()` loads it, and only tensors that are read cost
    memory. Call it before asking for the next name."""
    for file in _shards(path):
        with safe_open(path / file, framework="pt") as f:
            for name in f.keys():
                yield name, partial(f.get_tensor, name)


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
