"""The glm5_next text-decoder configuration, read from a Hugging Face `config.json`.

Both forms are accepted: nested (`{"text_config": {...}, "vision_config": {...}}`) and flat
(text fields at the top level). Defaults and derived schedules follow transformers 5.23.0's
`Glm5NextTextConfig` exactly, so a config means the same model here and in the reference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {"Glm5NextForConditionalGeneration", "Glm5NextForCausalLM", "Glm5NextModel"}
SUPPORTED_MODEL_TYPES = {"glm5_next", "glm5_next_text"}


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
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    qk_nope_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
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
    tie_word_embeddings: bool = False
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    indexer_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"config: {name} has {len(getattr(self, name))} entries for {n} layers")
        if bad := set(self.layer_types) - {"linear_attention", "indexed_attention"}:
            raise ValueError(f"config: unknown layer_types {sorted(bad)}")
        if bad := set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ValueError(f"config: unknown mlp_layer_types {sorted(bad)}")
        if bad := set(self.indexer_types) - {"full", "shared"}:
            raise ValueError(f"config: unknown indexer_types {sorted(bad)}")
        if self.attention_bias:
            raise ValueError("config: attention_bias=True is not supported by oxserve's MLA")
        if self.qk_rope_head_dim != 0:
            raise ValueError(f"config: glm5_next MLA is NoPE, got qk_rope_head_dim={self.qk_rope_head_dim}")
        if self.index_kpool < 1 or self.index_topk % self.index_kpool:
            raise ValueError(
                f"config: index_topk ({self.index_topk}) must be a multiple of index_kpool ({self.index_kpool})"
            )
        if self.n_routed_experts % self.n_group:
            raise ValueError("config: n_routed_experts must be divisible by n_group")
        for i in self.shared_indexer_layers:
            # The reference hands a layer's top-k only to the layer right after it.
            if i == 0 or not self.is_full_indexer_layer(i - 1):
                raise ValueError(
                    f"config: layer {i} reuses ('shared') the DSA selection, but layer {i - 1} "
                    "is not an indexed_attention layer with a full indexer"
                )

    # ---- derived views -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

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
        text = _text_fields(raw)
        known = {f.name for f in fields(cls)} - {"layer_types", "mlp_layer_types", "indexer_types"}
        values = {k: v for k, v in text.items() if k in known}
        if linear := text.get("linear_attn_config"):
            values.setdefault("linear_head_dim", linear.get("head_dim", cls.linear_head_dim))
            values.setdefault("linear_num_heads", linear.get("num_heads", cls.linear_num_heads))
            values.setdefault("linear_conv_kernel_dim", linear.get("short_conv_kernel_size", cls.linear_conv_kernel_dim))
            values.setdefault("linear_lower_bound", linear.get("gate_lower_bound", cls.linear_lower_bound))
        if "num_local_experts" in text and "n_routed_experts" not in text:
            values["n_routed_experts"] = text["num_local_experts"]
        n = int(values.get("num_hidden_layers", cls.num_hidden_layers))
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        values["eos_token_id"] = tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
        values["layer_types"] = tuple(_layer_types(text.get("layer_types"), n))
        values["mlp_layer_types"] = tuple(text.get("mlp_layer_types") or (["dense"] * min(3, n) + ["sparse"] * (n - 3)))
        values["indexer_types"] = tuple(_indexer_types(text, n))
        num_kv = text.get("num_key_value_heads")
        heads = values.get("num_attention_heads", cls.num_attention_heads)
        if num_kv is not None and num_kv != heads:
            raise ValueError(f"config: num_key_value_heads ({num_kv}) must equal num_attention_heads ({heads})")
        return cls(**values)

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


def check_architecture(raw: dict[str, Any]) -> None:
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if model_type not in SUPPORTED_MODEL_TYPES and not set(archs) & SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture: model_type={model_type!r}, architectures={archs}; "
            f"oxserve serves {sorted(SUPPORTED_MODEL_TYPES)}"
        )


def _text_fields(raw: dict[str, Any]) -> dict[str, Any]:
    text = raw.get("text_config")
    if text is None:  # flat, text-only checkpoint
        return dict(raw)
    merged = dict(text)
    for key in ("eos_token_id", "pad_token_id", "bos_token_id", "tie_word_embeddings"):
        if key not in merged and key in raw:
            merged[key] = raw[key]
    return merged


def _layer_types(given: list[str] | None, n: int) -> list[str]:
    if given is None:
        return ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    return ["indexed_attention" if t == "full_attention" else t for t in given]


def _indexer_types(text: dict[str, Any], n: int) -> list[str]:
    if text.get("indexer_types") is not None:
        return list(text["indexer_types"])
    pattern = text.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(text.get("index_topk_freq", 1), 1)
    offset = text.get("index_skip_topk_offset", 2)
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n)]
