"""The glm5_next text-decoder configuration, read from a Hugging Face `config.json`.

Both forms are accepted: nested (`{"text_config": {...}, "vision_config": {...}, ...}`) and flat
(text options at the top level, next to `Glm5NextConfig`'s own fields), split the way
transformers 5.23.0's `Glm5NextConfig` splits them.

The rule: every option the reference accepts is either honoured exactly (`TextModelConfig`
holds the value the reference resolves, defaults and derived schedules included) or rejected
at load with a `ConfigError` naming it; options with no effect on inference are accepted and
ignored. The tables below classify every option, and `tests/test_config_fidelity.py` fails if
the reference grows one they do not list. Configurations the reference accepts but cannot run
(it would fail mid-request, or pick arbitrarily) are rejected too, so oxserve fails at load.
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from oxserve.model.activations import activation

SUPPORTED_ARCHITECTURES = {"Glm5NextForConditionalGeneration", "Glm5NextForCausalLM", "Glm5NextModel"}
SUPPORTED_MODEL_TYPES = {"glm5_next", "glm5_next_text"}

# ---- every option the reference accepts, and what oxserve does with it ---------------------
# Text options: Glm5NextTextConfig's dataclass fields (PreTrainedConfig's included), the extra
# keys its and PreTrainedConfig's __post_init__ read, and its `attribute_map` alias.

# Resolved exactly as the reference resolves them, into the TextModelConfig fields.
TEXT_HONOURED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "rms_norm_eps", "max_position_embeddings", "hidden_act", "swiglu_limit",
    "num_key_value_heads",  # the reference requires it to equal num_attention_heads (default 64)
    "kv_lora_rank", "q_lora_rank", "v_head_dim", "qk_nope_head_dim",
    "n_shared_experts", "n_routed_experts", "num_local_experts", "routed_scaling_factor", "n_group",
    "topk_group", "num_experts_per_tok", "norm_topk_prob",
    "index_topk", "index_head_dim", "index_n_heads", "index_kpool", "index_kpool_always_select_tail",
    "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "linear_lower_bound",
    "linear_attn_config",  # its keys override the linear_* options (LINEAR_ATTN_KEYS)
    "hc_mult", "hc_eps", "hc_sinkhorn_iters",
    "layer_types", "mlp_layer_types", "indexer_types",
    "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset",  # derive indexer_types
    "eos_token_id", "pad_token_id", "bos_token_id",  # nested form: if absent here, the top-level id
})
# Accepted; no effect on inference.
TEXT_IGNORED = frozenset({
    # bookkeeping, training, outputs, and task heads
    "transformers_version", "architectures", "dtype", "torch_dtype", "name_or_path", "_commit_hash",
    "output_hidden_states", "return_dict", "output_attentions", "output_router_logits", "use_cache",
    "initializer_range", "router_aux_loss_coef", "attention_dropout", "chunk_size_feed_forward",
    "id2label", "label2id", "num_labels", "problem_type",
    "attn_implementation", "experts_implementation",  # kernel choice; same math
    "rope_scaling", "rope_theta",  # NoPE: qk_rope_head_dim is 0
    "head_dim",  # the reference overwrites it with qk_rope_head_dim
    "tie_word_embeddings",  # the reference ties on the top-level flag only (TOP_HONOURED)
    "is_encoder_decoder",  # generation reads the top-level flag (TOP_REJECTED)
})
# Run only at the given value (the reference default); anything else is a ConfigError.
TEXT_REJECTED: dict[str, Any] = {
    "attention_bias": False,  # oxserve's MLA has no biases
    "qk_rope_head_dim": 0,  # glm5_next MLA is NoPE; the reference rejects > 0, and < 0 cannot run
    "per_layer_config": None,  # per-layer overrides of the architecture
}

# Top-level options: Glm5NextConfig's dataclass fields (PreTrainedConfig's included).
TOP_HONOURED = frozenset({"text_config", "tie_word_embeddings"})
TOP_IGNORED = frozenset({
    "vision_config", "image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
    "video_start_token_id", "video_end_token_id",
    "transformers_version", "architectures", "dtype", "output_hidden_states", "return_dict",
    "chunk_size_feed_forward", "id2label", "label2id", "problem_type",
})
TOP_REJECTED: dict[str, Any] = {
    "is_encoder_decoder": False,  # the reference's generate() would run it as an encoder-decoder
}
TOP_OPTIONS = TOP_HONOURED | TOP_IGNORED | set(TOP_REJECTED)
# Any other key is stored by the reference as an attribute that glm5_next never reads.

# `linear_attn_config` key -> the option it overrides.
LINEAR_ATTN_KEYS = {
    "head_dim": "linear_head_dim",
    "num_heads": "linear_num_heads",
    "short_conv_kernel_size": "linear_conv_kernel_dim",
    "gate_lower_bound": "linear_lower_bound",
}
# Layer-type spellings the reference maps onto the two it runs (its own `full_attention`
# alias, then PreTrainedConfig's legacy names; `attention` becomes `full_attention` only after
# the glm5_next step, so the reference cannot run it).
LAYER_TYPE_ALIASES = {
    "full_attention": "indexed_attention",
    "deepseek_sparse_attention": "indexed_attention",
    "qwen_sparse_attention": "indexed_attention",
    "mamba": "linear_attention",
}
IDS = ("eos_token_id", "pad_token_id", "bos_token_id")


class ConfigError(ValueError):
    """A configuration oxserve will not run; `option` is the option to blame, named in the message."""

    def __init__(self, option: str, problem: str):
        super().__init__(f"config: {problem}")
        self.option = option
        self.problem = problem


@dataclass(frozen=True)
class TextModelConfig:
    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 288
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 1536
    v_head_dim: int = 256
    qk_nope_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    tie_word_embeddings: bool = False  # the top-level flag: the one the reference ties on
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = 154820
    bos_token_id: int | None = None
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    indexer_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            if not _type_ok(getattr(self, f.name), _HINTS[f.name]):
                # The reference's strict dataclass refuses these too (1 is not a float, 1 is not a bool).
                raise ConfigError(f.name, f"{f.name} must be {_hint_name(_HINTS[f.name])}, got {getattr(self, f.name)!r}")
        try:
            activation(self.hidden_act)
        except ValueError as e:
            raise ConfigError("hidden_act", str(e)) from None
        for name in _POSITIVE:
            if getattr(self, name) < 1:
                raise ConfigError(name, f"{name} must be at least 1, got {getattr(self, name)}")
        if self.n_shared_experts < 0:
            raise ConfigError("n_shared_experts", f"n_shared_experts must not be negative, got {self.n_shared_experts}")
        self._check_schedules()
        if self.index_topk % self.index_kpool:
            raise ConfigError("index_topk", f"index_topk ({self.index_topk}) must be a multiple of index_kpool ({self.index_kpool})")
        self._check_routing()

    def _check_schedules(self) -> None:
        n = self.num_hidden_layers
        allowed = {
            "layer_types": {"linear_attention", "indexed_attention"},
            "mlp_layer_types": {"dense", "sparse"},
            "indexer_types": {"full", "shared"},
        }
        for name, values in allowed.items():
            schedule = getattr(self, name)
            if len(schedule) != n:
                raise ConfigError(name, f"{name} has {len(schedule)} entries for {n} layers")
            if bad := set(schedule) - values:
                raise ConfigError(name, f"{name} has entries {sorted(bad)}; oxserve runs {sorted(values)}")
        for i in self.shared_indexer_layers:
            # The reference hands a layer's top-k only to the layer right after it.
            if i == 0 or not self.is_full_indexer_layer(i - 1):
                raise ConfigError(
                    "indexer_types",
                    f"indexer_types: layer {i} reuses ('shared') the DSA selection, but layer {i - 1} "
                    "is not an indexed_attention layer with a full indexer",
                )

    def _check_routing(self) -> None:
        """The reference's router: experts in n_group equal groups, each scored by its top-2
        experts; the best topk_group groups stay eligible, top-k experts are picked among them."""
        experts, groups = self.n_routed_experts, self.n_group
        if experts % groups:
            raise ConfigError("n_group", f"n_routed_experts ({experts}) must be divisible by n_group ({groups})")
        per_group = experts // groups
        if per_group < 2:
            raise ConfigError(
                "n_group", f"n_group ({groups}) leaves {per_group} expert per group; groups are scored by their top-2 experts"
            )
        if self.topk_group > groups:
            raise ConfigError("topk_group", f"topk_group ({self.topk_group}) must not exceed n_group ({groups})")
        if self.num_experts_per_tok > self.topk_group * per_group:
            # The reference would fill the rest from masked-out (-inf) experts, in arbitrary order.
            raise ConfigError(
                "num_experts_per_tok",
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the {self.topk_group * per_group} experts "
                f"in topk_group ({self.topk_group}) groups",
            )

    # ---- derived views -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim  # NoPE: no rotary part

    @property
    def kda_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    def is_mla_layer(self, i: int) -> bool:
        return self.layer_types[i] == "indexed_attention"

    def is_full_indexer_layer(self, i: int) -> bool:
        return self.is_mla_layer(i) and self.indexer_types[i] == "full"

    @property
    def mla_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_mla_layer(i)]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_mla_layer(i)]

    @property
    def full_indexer_layers(self) -> list[int]:
        return [i for i in self.mla_layers if self.indexer_types[i] == "full"]

    @property
    def shared_indexer_layers(self) -> list[int]:
        return [i for i in self.mla_layers if self.indexer_types[i] == "shared"]

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "TextModelConfig":
        top, text = _split(raw)
        for options, rejected in ((top, TOP_REJECTED), (text, TEXT_REJECTED)):
            for name, supported in rejected.items():
                if name in options and not _same(options[name], supported):
                    raise ConfigError(name, f"{name}={options[name]!r} is not supported; oxserve runs {name}={supported!r}")
        n = text.get("num_hidden_layers", cls.num_hidden_layers)
        if not _type_ok(n, int) or n < 1:  # needed now, to derive the schedules
            raise ConfigError("num_hidden_layers", f"num_hidden_layers must be a positive int, got {n!r}")

        values = {f: text[f] for f in _TEXT_FIELDS if f in text}
        origin: dict[str, str] = {}  # field -> the option that set it, when that is another option
        if "num_local_experts" in text:  # the alias is assigned after the fields, so it wins
            values["n_routed_experts"] = text["num_local_experts"]
            origin["n_routed_experts"] = "num_local_experts"
        _apply_linear_attn_config(text, values, origin)
        for name in IDS:  # text-level value, else the top-level one (nested form)
            if name in text or name in raw:
                values[name] = text[name] if name in text else raw[name]
        eos = values.get("eos_token_id")
        values["eos_token_id"] = tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,)
        values["tie_word_embeddings"] = top.get("tie_word_embeddings", False)
        values.update(_schedules(text, n))
        try:
            cfg = cls(**values)
        except ConfigError as e:
            if e.option not in origin:
                raise
            raise ConfigError(origin[e.option], f"{e.problem} (set by {origin[e.option]})") from None

        kv_heads = text.get("num_key_value_heads", 64)  # the reference's default, whatever the head count
        if not _same(kv_heads, cfg.num_attention_heads):
            given = "" if "num_key_value_heads" in text else ", the reference's default when absent"
            raise ConfigError(
                "num_key_value_heads",
                f"num_key_value_heads ({kv_heads!r}{given}) must equal num_attention_heads ({cfg.num_attention_heads})",
            )
        # The reference's embedding takes the text-level id as padding_idx (absent: its default).
        pad = text.get("pad_token_id", cls.pad_token_id)
        if pad is not None and not -cfg.vocab_size <= pad < cfg.vocab_size:
            raise ConfigError(
                "pad_token_id", f"pad_token_id {pad} is outside the vocabulary (vocab_size {cfg.vocab_size})"
            )
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "TextModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no config.json at {path}")
        raw = json.loads(path.read_text())
        check_architecture(raw)
        return cls.from_hf_dict(raw)


_HINTS = get_type_hints(TextModelConfig)
# Options read straight into the field of the same name; the rest are assembled in from_hf_dict.
_TEXT_FIELDS = {f.name for f in fields(TextModelConfig)} - {"tie_word_embeddings", "layer_types", "mlp_layer_types", "indexer_types", *IDS}
_POSITIVE = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "n_routed_experts", "n_group", "topk_group", "num_experts_per_tok",
    "kv_lora_rank", "q_lora_rank", "v_head_dim", "qk_nope_head_dim", "max_position_embeddings",
    "index_topk", "index_head_dim", "index_n_heads", "index_kpool",
    "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "hc_mult",
)


def check_architecture(raw: dict[str, Any]) -> None:
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if model_type not in SUPPORTED_MODEL_TYPES and not set(archs) & SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture: model_type={model_type!r}, architectures={archs}; "
            f"oxserve serves {sorted(SUPPORTED_MODEL_TYPES)}"
        )


def _type_ok(value: Any, hint: Any) -> bool:
    if isinstance(hint, types.UnionType):
        return any(_type_ok(value, h) for h in get_args(hint))
    if get_origin(hint) is tuple:
        return isinstance(value, tuple) and all(_type_ok(v, get_args(hint)[0]) for v in value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _hint_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint)


def _same(value: Any, expected: Any) -> bool:
    return type(value) is type(expected) and value == expected


def _split(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(top-level options, text options), split as the reference splits them."""
    top = {k: v for k, v in raw.items() if k in TOP_OPTIONS}
    text = raw.get("text_config")
    if text is None:  # flat: whatever is not a Glm5NextConfig field is a text option
        return top, {k: v for k, v in raw.items() if k not in TOP_OPTIONS}
    if not isinstance(text, dict):
        raise ConfigError("text_config", f"text_config must be a dict, got {type(text).__name__}")
    return top, text


def _apply_linear_attn_config(text: dict[str, Any], values: dict[str, Any], origin: dict[str, str]) -> None:
    """The reference's `linear_attn_config`: its keys override the top-level linear_* options, and
    with `safe_gate` (default true) an unset lower bound becomes -5.0."""
    linear = text.get("linear_attn_config")
    if linear is None:
        return
    if not isinstance(linear, dict):
        raise ConfigError("linear_attn_config", f"linear_attn_config must be a dict, got {type(linear).__name__}")
    for key, field in LINEAR_ATTN_KEYS.items():
        if key in linear:
            values[field] = linear[key]
            origin[field] = f"linear_attn_config.{key}"
    if linear.get("safe_gate", True) and values.get("linear_lower_bound", TextModelConfig.linear_lower_bound) is None:
        values["linear_lower_bound"] = -5.0


def _schedules(text: dict[str, Any], n: int) -> dict[str, Any]:
    """The per-layer schedules, given or derived as the reference derives them."""
    layer_types = text.get("layer_types")
    if layer_types is None:
        layer_types = ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    elif isinstance(layer_types, list):
        layer_types = [LAYER_TYPE_ALIASES.get(t, t) if isinstance(t, str) else t for t in layer_types]
    mlp_layer_types = text.get("mlp_layer_types")
    if mlp_layer_types is None:
        mlp_layer_types = ["dense"] * min(3, n) + ["sparse"] * (n - 3)
    schedules = {
        "layer_types": layer_types,
        "mlp_layer_types": mlp_layer_types,
        "indexer_types": _indexer_types(text, n),
    }
    # Lists become tuples; anything else is left for the type check to name.
    return {k: tuple(v) if isinstance(v, list) else v for k, v in schedules.items()}


def _indexer_types(text: dict[str, Any], n: int) -> Any:
    """indexer_types if given, else index_topk_pattern ("FSF..." or a list), else the
    index_topk_freq / index_skip_topk_offset rule."""
    if text.get("indexer_types") is not None:
        return text["indexer_types"]
    pattern = text.get("index_topk_pattern")
    if isinstance(pattern, str):
        if bad := set(pattern) - {"F", "S"}:
            raise ConfigError("index_topk_pattern", f"index_topk_pattern has letters {sorted(bad)}; only F and S exist")
        return [{"F": "full", "S": "shared"}[c] for c in pattern]
    if pattern is not None:
        return pattern
    freq, offset = text.get("index_topk_freq", 1), text.get("index_skip_topk_offset", 2)
    for name, value in (("index_topk_freq", freq), ("index_skip_topk_offset", offset)):
        if not isinstance(value, (int, float)):
            raise ConfigError(name, f"{name} must be a number, got {value!r}")
    freq = max(freq, 1)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
