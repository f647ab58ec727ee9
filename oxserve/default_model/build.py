"""Writes a small GLM-5.3-Flash-shaped checkpoint: seeded random weights plus a BPE tokenizer.

The files match what transformers' `Glm5NextForConditionalGeneration.save_pretrained` writes
for such a model: the nested `config.json`, checkpoint-form weight names (per-expert
projections, split q/k/v convolutions, `hc_*` and forget-gate names), the tensors that HF
keeps in float32 stored as float32, and values drawn the way its `_init_weights` draws them.
Only torch and tokenizers are needed; transformers is a test-only dependency.

Every tensor has its own generator, seeded from (seed, name), so a tensor's values do not
depend on which other tensors exist or on the order they are written in.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

# ---- tokenizer vocabulary ----------------------------------------------------------------

# GLM-style special tokens, then the multimodal placeholders; the trainer puts them first,
# so their ids are fixed and known without training.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<pad>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|video|>",
)
TOKEN_IDS = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
EOS_TOKEN, PAD_TOKEN, BOS_TOKEN = "<|endoftext|>", "<pad>", "<sop>"
# GLM stops a turn at end-of-text or when the model starts the next user/tool turn.
STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")
TOKENIZER_VOCAB_SIZE = 8192  # all ids, the markup tokens included

# Markup the model writes as text (reasoning, tool calls): single tokens, but not special,
# so decoded outputs keep them for the reasoning and tool-call parsers. Added after the
# trained vocabulary, so the trained ids do not move.
TEXT_MARKUP_TOKENS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_response>",
    "</tool_response>",
)

CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text()

# ---- configuration ---------------------------------------------------------------------

# Glm5NextTextConfig defaults that the math depends on, written out so config.json says them.
_HF_TEXT_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1048576,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "swiglu_limit": 10.0,
    "linear_lower_bound": -5.0,
    "hc_eps": 1e-6,
    "hc_sinkhorn_iters": 20,
    "index_kpool_always_select_tail": True,
    "tie_word_embeddings": False,
    "use_cache": True,
}

_SMALL_SHAPE: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "intermediate_size": 1024,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 256,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 192,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "qk_rope_head_dim": 0,
    "index_n_heads": 4,
    "index_head_dim": 64,
    "index_topk": 256,
    "index_kpool": 4,
    "linear_num_heads": 8,
    "linear_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "hc_mult": 4,
}

_TOKEN_CONFIG = {
    "eos_token_id": TOKEN_IDS[EOS_TOKEN],
    "pad_token_id": TOKEN_IDS[PAD_TOKEN],
    "bos_token_id": TOKEN_IDS[BOS_TOKEN],
}

_SCHEDULES = ("layer_types", "mlp_layer_types", "indexer_types")


def _default_schedules(num_layers: int) -> dict[str, list[str]]:
    return {
        "layer_types": ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)],
        "mlp_layer_types": ["dense"] + ["sparse"] * (num_layers - 1),
        "indexer_types": ["full"] * num_layers,
    }


def make_text_config(**overrides: Any) -> dict[str, Any]:
    """The small text config with `overrides` applied.

    Per-layer schedules not given are derived for the (possibly overridden) layer count:
    layer i is MLA/DSA when i % 4 == 3, layer 0 is dense, every indexer is "full".
    """
    config = {**_HF_TEXT_DEFAULTS, **_SMALL_SHAPE, **_TOKEN_CONFIG, **overrides}
    config = {**_default_schedules(config["num_hidden_layers"]), **config}
    for key in _SCHEDULES:
        if len(config[key]) != config["num_hidden_layers"]:
            raise ValueError(
                f"{key} has {len(config[key])} entries for {config['num_hidden_layers']} layers; "
                "leave it out to have it derived"
            )
    return config


SMALL_TEXT_CONFIG: dict[str, Any] = make_text_config()


def vision_config(out_hidden_size: int) -> dict[str, Any]:
    """A one-block vision tower: present so HF loads with no missing keys, cheap to carry."""
    return {
        "model_type": "glm5_next_vision",
        "depth": 1,
        "hidden_size": 32,
        "num_heads": 2,
        "intermediate_size": 64,
        "out_hidden_size": out_hidden_size,
        "projection_intermediate_size": 64,
        "hidden_act": "silu",
        "attention_bias": True,
        "in_channels": 3,
        "image_size": 336,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "swiglu_limit": 10.0,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
    }


def model_config(text: dict[str, Any], dtype: torch.dtype, vision: dict[str, Any] | None = None) -> dict[str, Any]:
    """The checkpoint's config; `vision` overrides fields of the small vision tower."""
    return {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "dtype": str(dtype).removeprefix("torch."),
        "tie_word_embeddings": False,
        "image_token_id": TOKEN_IDS["<|image|>"],
        "video_token_id": TOKEN_IDS["<|video|>"],
        "image_start_token_id": TOKEN_IDS["<|begin_of_image|>"],
        "image_end_token_id": TOKEN_IDS["<|end_of_image|>"],
        "video_start_token_id": TOKEN_IDS["<|begin_of_video|>"],
        "video_end_token_id": TOKEN_IDS["<|end_of_video|>"],
        "text_config": {**text, "model_type": "glm5_next_text"},
        "vision_config": {**vision_config(text["hidden_size"]), **(vision or {})},
    }


def generation_config() -> dict[str, Any]:
    return {
        "bos_token_id": TOKEN_IDS[BOS_TOKEN],
        "eos_token_id": [TOKEN_IDS[t] for t in STOP_TOKENS],
        "pad_token_id": TOKEN_IDS[PAD_TOKEN],
    }


# ---- tensor specs --------------------------------------------------------------------

Init = Callable[[torch.Tensor, torch.Generator], Any]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    init: Init
    fp32: bool = False  # HF's _keep_in_fp32_modules_strict: stored as float32 whatever the dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _normal(std: float) -> Init:
    return lambda t, g: t.normal_(0.0, std, generator=g)


def _fill(value: float) -> Init:
    return lambda t, g: t.fill_(value)


_ONES, _ZEROS = _fill(1.0), _fill(0.0)


def _embedding(std: float, padding_idx: int | None) -> Init:
    def init(t: torch.Tensor, g: torch.Generator) -> None:
        t.normal_(0.0, std, generator=g)
        if padding_idx is not None:
            t[padding_idx] = 0.0  # as nn.Embedding(padding_idx=...) after HF init

    return init


def _conv1d_default(kernel_size: int) -> Init:
    # nn.Conv1d's kaiming_uniform(a=sqrt(5)) bound for a depthwise conv: 1/sqrt(fan_in), fan_in = K.
    bound = 1.0 / math.sqrt(kernel_size)
    return lambda t, g: t.uniform_(-bound, bound, generator=g)


def _dt_bias(t: torch.Tensor, g: torch.Generator) -> None:
    # FLA/HF: dt log-uniform in [1e-3, 1e-1], stored as its inverse softplus.
    t.uniform_(math.log(1e-3), math.log(1e-1), generator=g)
    dt = t.exp().clamp_min(1e-4)
    t.copy_(dt + torch.log(-torch.expm1(-dt)))


def _log_uniform_1_16(t: torch.Tensor, g: torch.Generator) -> None:
    t.uniform_(1.0, 16.0, generator=g).log_()


def _norm(name: str, size: int) -> TensorSpec:
    return TensorSpec(f"{name}.weight", (size,), _ONES)


def _linear(name: str, out_dim: int, in_dim: int, std: float, bias: bool = False) -> Iterator[TensorSpec]:
    yield TensorSpec(f"{name}.weight", (out_dim, in_dim), _normal(std))
    if bias:
        yield TensorSpec(f"{name}.bias", (out_dim,), _ZEROS)


def _swiglu(prefix: str, hidden: int, inner: int, std: float, bias: bool = False) -> Iterator[TensorSpec]:
    yield from _linear(prefix + "gate_proj", inner, hidden, std, bias)
    yield from _linear(prefix + "up_proj", inner, hidden, std, bias)
    yield from _linear(prefix + "down_proj", hidden, inner, std, bias)


def _hyper_connection(prefix: str, c: dict[str, Any]) -> Iterator[TensorSpec]:
    m = c["hc_mult"]
    width = (2 + m) * m  # pre (m) + post (m) + comb (m * m) mixing weights
    for kind in ("attn", "ffn"):
        yield TensorSpec(f"{prefix}hc_{kind}_fn", (width, m * c["hidden_size"]), _normal(0.02))
        yield TensorSpec(f"{prefix}hc_{kind}_base", (width,), _ZEROS, fp32=True)
        yield TensorSpec(f"{prefix}hc_{kind}_scale", (3,), _ONES, fp32=True)


def _kda(prefix: str, c: dict[str, Any]) -> Iterator[TensorSpec]:
    hidden, std = c["hidden_size"], c["initializer_range"]
    heads, head_dim = c["linear_num_heads"], c["linear_head_dim"]
    dim, kernel = heads * head_dim, c["linear_conv_kernel_dim"]
    for x in "qkv":
        yield from _linear(f"{prefix}{x}_proj", dim, hidden, std)
    for x in "qkv":
        yield TensorSpec(f"{prefix}{x}_conv1d.weight", (dim, 1, kernel), _conv1d_default(kernel), fp32=True)
    yield from _linear(prefix + "f_a_proj", head_dim, hidden, std)
    yield from _linear(prefix + "f_b_proj", dim, head_dim, std)
    yield TensorSpec(prefix + "dt_bias", (dim,), _dt_bias, fp32=True)
    a_log = _ZEROS if c["linear_lower_bound"] is not None else _log_uniform_1_16
    yield TensorSpec(prefix + "A_log", (heads,), a_log, fp32=True)
    yield from _linear(prefix + "b_proj", heads, hidden, std)
    yield from _linear(prefix + "g_a_proj", head_dim, hidden, std)
    yield from _linear(prefix + "g_b_proj", dim, head_dim, std)
    yield _norm(prefix + "o_norm", head_dim)
    yield from _linear(prefix + "o_proj", hidden, dim, std)


def _indexer(prefix: str, c: dict[str, Any]) -> Iterator[TensorSpec]:
    hidden, std = c["hidden_size"], c["initializer_range"]
    heads, head_dim = c["index_n_heads"], c["index_head_dim"]
    yield from _linear(prefix + "wq_b", heads * head_dim, c["q_lora_rank"], std)
    yield from _linear(prefix + "wk", head_dim, hidden, std)
    yield _norm(prefix + "k_norm", head_dim)
    yield TensorSpec(prefix + "k_norm.bias", (head_dim,), _ZEROS)
    yield from _linear(prefix + "weights_proj", heads, hidden, std)
    yield TensorSpec(prefix + "index_kpool_compress_ape", (c["index_kpool"], head_dim), _ZEROS)
    yield TensorSpec(prefix + "index_kpool_compress_gate", (head_dim, hidden), _ONES)


def _mla(prefix: str, c: dict[str, Any], full_indexer: bool) -> Iterator[TensorSpec]:
    hidden, std, bias = c["hidden_size"], c["initializer_range"], c["attention_bias"]
    heads, q_rank, kv_rank = c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    qk_head_dim = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    yield from _linear(prefix + "q_a_proj", q_rank, hidden, std, bias)
    yield _norm(prefix + "q_a_layernorm", q_rank)
    yield from _linear(prefix + "q_b_proj", heads * qk_head_dim, q_rank, std)
    yield from _linear(prefix + "kv_a_proj_with_mqa", kv_rank + c["qk_rope_head_dim"], hidden, std, bias)
    yield _norm(prefix + "kv_a_layernorm", kv_rank)
    yield from _linear(prefix + "kv_b_proj", heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), kv_rank, std)
    yield from _linear(prefix + "o_proj", hidden, heads * c["v_head_dim"], std, bias)
    if full_indexer:  # "shared" layers reuse the previous layer's selection and own no indexer
        yield from _indexer(prefix + "indexer.", c)


def _moe(prefix: str, c: dict[str, Any]) -> Iterator[TensorSpec]:
    hidden, std, inner = c["hidden_size"], c["initializer_range"], c["moe_intermediate_size"]
    for e in range(c["n_routed_experts"]):
        yield from _swiglu(f"{prefix}experts.{e}.", hidden, inner, std)
    yield from _linear(prefix + "gate", c["n_routed_experts"], hidden, std)
    yield TensorSpec(prefix + "gate.e_score_correction_bias", (c["n_routed_experts"],), _ZEROS, fp32=True)
    yield from _swiglu(prefix + "shared_experts.", hidden, inner * c["n_shared_experts"], std)


def _decoder_layer(prefix: str, c: dict[str, Any], i: int) -> Iterator[TensorSpec]:
    yield from _hyper_connection(prefix, c)
    yield _norm(prefix + "input_layernorm", c["hidden_size"])
    yield _norm(prefix + "post_attention_layernorm", c["hidden_size"])
    if c["layer_types"][i] == "linear_attention":
        yield from _kda(prefix + "self_attn.", c)
    else:
        yield from _mla(prefix + "self_attn.", c, full_indexer=c["indexer_types"][i] == "full")
    if c["mlp_layer_types"][i] == "sparse":
        yield from _moe(prefix + "mlp.", c)
    else:
        yield from _swiglu(prefix + "mlp.", c["hidden_size"], c["intermediate_size"], c["initializer_range"])


def _mtp_layer(prefix: str, c: dict[str, Any]) -> Iterator[TensorSpec]:
    """The MTP layer as GLM-5.3-Flash ships it: MLA + DSA and MoE, no hyper-connections; it
    shares the model's embedding and head."""
    hidden = c["hidden_size"]
    for norm in ("enorm", "hnorm", "shared_head.norm", "input_layernorm", "post_attention_layernorm"):
        yield _norm(prefix + norm, hidden)
    yield from _linear(prefix + "eh_proj", hidden, 2 * hidden, c["initializer_range"])
    yield from _mla(prefix + "self_attn.", c, full_indexer=True)
    yield from _moe(prefix + "mlp.", c)


def _text_model(c: dict[str, Any], mtp: bool) -> Iterator[TensorSpec]:
    prefix, std = "model.language_model.", c["initializer_range"]
    vocab, hidden = c["vocab_size"], c["hidden_size"]
    yield TensorSpec(prefix + "embed_tokens.weight", (vocab, hidden), _embedding(std, c["pad_token_id"]))
    for i in range(c["num_hidden_layers"]):
        yield from _decoder_layer(f"{prefix}layers.{i}.", c, i)
    if mtp:
        yield from _mtp_layer(f"{prefix}layers.{c['num_hidden_layers']}.", c)
    yield _norm(prefix + "norm", hidden)
    yield from _linear("lm_head", vocab, hidden, std)


def _vision_model(v: dict[str, Any]) -> Iterator[TensorSpec]:
    prefix, std, bias = "model.visual.", v["initializer_range"], v["attention_bias"]
    hidden, out, merge = v["hidden_size"], v["out_hidden_size"], v["spatial_merge_size"]
    patch = (hidden, v["in_channels"], v["temporal_patch_size"], v["patch_size"], v["patch_size"])
    yield TensorSpec(prefix + "patch_embed.proj.weight", patch, _normal(std))
    yield TensorSpec(prefix + "patch_embed.proj.bias", (hidden,), _ZEROS)
    for b in range(v["depth"]):
        block = f"{prefix}blocks.{b}."
        yield _norm(block + "norm1", hidden)
        yield _norm(block + "norm2", hidden)
        yield from _linear(block + "attn.qkv", 3 * hidden, hidden, std, bias)
        yield from _linear(block + "attn.proj", hidden, hidden, std, bias)
        yield _norm(block + "attn.q_norm", hidden // v["num_heads"])
        yield _norm(block + "attn.k_norm", hidden // v["num_heads"])
        yield from _swiglu(block + "mlp.", hidden, v["intermediate_size"], std, bias)
    yield _norm(prefix + "post_layernorm", hidden)
    yield TensorSpec(prefix + "downsample.weight", (out, hidden, merge, merge), _normal(std))
    yield TensorSpec(prefix + "downsample.bias", (out,), _ZEROS)
    yield from _linear(prefix + "merger.proj", out, out, std)
    yield _norm(prefix + "merger.post_projection_norm", out)
    yield TensorSpec(prefix + "merger.post_projection_norm.bias", (out,), _ZEROS)
    yield from _swiglu(prefix + "merger.", out, v["projection_intermediate_size"], std)


def tensor_specs(config: dict[str, Any], mtp: bool = False) -> list[TensorSpec]:
    """Every tensor of the checkpoint for a `model_config(...)` dict, in writing order."""
    return [*_text_model(config["text_config"], mtp), *_vision_model(config["vision_config"])]


# ---- weights: materialise and stream into safetensors ------------------------------------

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _storage_dtype(spec: TensorSpec, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if spec.fp32 else dtype


def _nbytes(spec: TensorSpec, dtype: torch.dtype) -> int:
    return spec.numel * _storage_dtype(spec, dtype).itemsize


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


def materialize(spec: TensorSpec, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """The tensor a checkpoint built with `seed` and `dtype` stores under `spec.name`."""
    values = torch.empty(spec.shape, dtype=torch.float32)
    spec.init(values, _generator(seed, spec.name))
    return values.to(_storage_dtype(spec, dtype))


def _write_safetensors(path: Path, specs: list[TensorSpec], seed: int, dtype: torch.dtype) -> None:
    """Writes the header from the specs alone, then each tensor as soon as it exists.

    Layout (safetensors): u64 little-endian header length | JSON header padded with spaces
    to 8 bytes | the tensors' bytes back to back, at the header's data_offsets.
    """
    header: dict[str, Any] = {}
    offset = 0
    for spec in specs:
        end = offset + _nbytes(spec, dtype)
        header[spec.name] = {
            "dtype": _SAFETENSORS_DTYPES[_storage_dtype(spec, dtype)],
            "shape": list(spec.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for spec in specs:
            f.write(materialize(spec, seed, dtype).view(torch.uint8).numpy().data)


def _plan_shards(
    specs: list[TensorSpec], dtype: torch.dtype, max_bytes: int | None
) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = _nbytes(spec, dtype)
        if max_bytes is not None and shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _write_weights(
    out: Path, specs: list[TensorSpec], seed: int, dtype: torch.dtype, max_bytes: int | None
) -> None:
    shards = _plan_shards(specs, dtype, max_bytes)
    if len(shards) == 1:
        _write_safetensors(out / "model.safetensors", specs, seed, dtype)
        return
    weight_map = {}
    for k, shard in enumerate(shards, start=1):
        filename = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(out / filename, shard, seed, dtype)
        weight_map.update({spec.name: filename for spec in shard})
    metadata = {
        "total_parameters": sum(spec.numel for spec in specs),
        "total_size": sum(_nbytes(spec, dtype) for spec in specs),
    }
    index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / "model.safetensors.index.json", index)


# ---- tokenizer -------------------------------------------------------------------------


def corpus_files() -> list[Path]:
    return sorted(Path(__file__).parent.glob("*.txt"))


def train_tokenizer(files: list[Path] | None = None) -> Tokenizer:
    """Byte-level BPE on `files` (default: the shipped corpus): every string encodes, and
    decodes back unchanged."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE - len(TEXT_MARKUP_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(p) for p in files or corpus_files()], trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_MARKUP_TOKENS])
    return tokenizer


def tokenizer_config(text: dict[str, Any]) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": text["max_position_embeddings"],
        "padding_side": "left",
    }


# ---- the checkpoint --------------------------------------------------------------------


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _check_token_ids(text: dict[str, Any], with_tokenizer: bool) -> None:
    vocab = text["vocab_size"]
    needed = TOKENIZER_VOCAB_SIZE if with_tokenizer else len(SPECIAL_TOKENS)
    if needed > vocab:
        raise ValueError(f"vocab_size {vocab} cannot hold the {needed} tokenizer ids")
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        ids = text[key] if isinstance(text[key], list) else [text[key]]
        if any(i is not None and not 0 <= i < vocab for i in ids):
            raise ValueError(f"{key}={text[key]} lies outside the vocabulary of {vocab}")


def build_checkpoint(
    out_dir: str | Path,
    text_config: dict[str, Any] = SMALL_TEXT_CONFIG,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int | None = None,
    tokenizer: bool = True,
    mtp: bool = False,
    vision: dict[str, Any] | None = None,
) -> Path:
    """Writes config, generation config, weights and (optionally) the tokenizer into `out_dir`.

    `text_config` is completed by `make_text_config`, so a partial dict works. Weights are
    one `model.safetensors`, or shards plus `model.safetensors.index.json` when they exceed
    `max_shard_bytes`. With `mtp`, the checkpoint also holds an MTP layer after the decoder
    layers (transformers ignores it). `vision` overrides fields of the vision tower's config.
    """
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; use one of {list(_SAFETENSORS_DTYPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = make_text_config(**text_config)
    _check_token_ids(text, tokenizer)
    config = model_config(text, dtype, vision)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config())
    _write_weights(out, tensor_specs(config, mtp), seed, dtype, max_shard_bytes)
    if tokenizer:
        train_tokenizer().save(str(out / "tokenizer.json"))
        _write_json(out / "tokenizer_config.json", tokenizer_config(text))
    return out
