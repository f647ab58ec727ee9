"""Checkpoint loading: both config forms, shards, extra tensors, and clear errors."""

from __future__ import annotations

import json
import shutil
from dataclasses import fields

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_models import TINY_TEXT_CONFIG
from oxserve.default_model import build_checkpoint
from oxserve.model.config import TextModelConfig
from oxserve.model import loader
from oxserve.model.linear import Linear, loadable, swap_linears
from oxserve.model.loader import CheckpointError, load_model
from oxserve_forward import ForcedRun


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt"), TINY_TEXT_CONFIG, seed=3, dtype=torch.float32, tokenizer=False)


def _copy(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _edit_weights(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def test_mtp_and_vision_tensors_are_not_read_unless_asked_for(tmp_path, monkeypatch):
    """On the real checkpoint they are gigabytes: a plain load must not even read them."""
    path = build_checkpoint(tmp_path / "m", TINY_TEXT_CONFIG, seed=3, dtype=torch.float32, tokenizer=False, mtp=True)
    read: list[str] = []
    real_open = loader.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.file = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    n = TINY_TEXT_CONFIG["num_hidden_layers"]
    plain = load_model(path, dtype=torch.float32)
    assert read and not any(".visual." in r or f".layers.{n}." in r for r in read)
    assert plain.model.mtp is None
    read.clear()
    drafting = load_model(path, dtype=torch.float32, with_mtp=True)
    assert any(f".layers.{n}.eh_proj" in r for r in read) and not any(".visual." in r for r in read)
    ref = load_file(path / "model.safetensors")
    torch.testing.assert_close(drafting.model.mtp.eh_proj.weight, ref[f"model.language_model.layers.{n}.eh_proj.weight"])
    q = ref["model.language_model.layers.0.self_attn.q_proj.weight"]
    torch.testing.assert_close(plain.model.layers[0].self_attn.qkv_proj.weight[: q.shape[0]], q)


def test_flat_config_and_sharded_weights(checkpoint, tmp_path):
    path = tmp_path / "flat"
    build_checkpoint(path, TINY_TEXT_CONFIG, seed=3, dtype=torch.float32, tokenizer=False, max_shard_bytes=200_000)
    assert (path / "model.safetensors.index.json").exists()
    raw = json.loads((path / "config.json").read_text())
    flat = {**raw.pop("text_config"), "architectures": raw["architectures"]}
    (path / "config.json").write_text(json.dumps(flat))
    a = load_model(path, dtype=torch.float32).model.state_dict()
    b = load_model(checkpoint, dtype=torch.float32).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_missing_tensor_is_named(checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path)
    _edit_weights(path, lambda t: t.pop("model.language_model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"layers\.1\.self_attn\.qkv_proj"):
        load_model(path, dtype=torch.float32)


def test_misshaped_tensor_is_named(checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path)
    name = "model.language_model.layers.3.self_attn.kv_b_proj.weight"
    _edit_weights(path, lambda t: t.update({name: torch.zeros(3, 3)}))
    with pytest.raises(CheckpointError, match=rf"{name}.*shape \(3, 3\)"):
        load_model(path, dtype=torch.float32)


def test_unknown_architecture(checkpoint, tmp_path):
    path = _copy(checkpoint, tmp_path)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(path)


def test_shared_indexer_must_follow_a_full_one():
    cfg = dict(TINY_TEXT_CONFIG, indexer_types=["full", "full", "full", "shared"])
    with pytest.raises(ValueError, match="layer 3 reuses"):
        TextModelConfig.from_hf_dict(cfg)


@pytest.mark.parametrize("raw", [{"text_config": {"num_hidden_layers": 8}}, {"num_hidden_layers": 8}], ids=["nested", "flat"])
def test_config_defaults_follow_the_reference(raw):
    from transformers import Glm5NextConfig
    from test_config_fidelity import reference_fields

    ours = TextModelConfig.from_hf_dict(raw)
    assert {f.name: getattr(ours, f.name) for f in fields(ours)} == reference_fields(Glm5NextConfig(**raw), raw)


def test_engine_without_tokenizer_takes_token_ids(checkpoint):
    from oxserve import LLM, SamplingParams

    llm = LLM(model=str(checkpoint), dtype="float32")
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text", SamplingParams(max_tokens=3))


def test_attention_bias_is_rejected_by_the_config():
    with pytest.raises(ValueError, match="attention_bias"):
        TextModelConfig.from_hf_dict(dict(TINY_TEXT_CONFIG, attention_bias=True))


class TransposedLinear(torch.nn.Module):
    """Another storage for a projection: W^T (still called `weight`, the checkpoint's name),
    filled part by part through its own loader."""

    def __init__(self, linear: Linear):
        super().__init__()
        self.out_parts = linear.out_parts
        weight = torch.empty(linear.in_features, sum(linear.out_parts))
        self.weight = loadable(torch.nn.Parameter(weight, requires_grad=False), self._load)

    def _load(self, param, tensor, shard) -> int:
        start = sum(self.out_parts[: shard.part]) if shard.part is not None else 0
        dest = param.data[:, start : start + tensor.shape[0]]
        dest.copy_(tensor.T)
        return dest.numel()

    def forward(self, x):
        return x @ self.weight

    def dense_weight(self):
        return self.weight.T


def test_swapped_linears_load_themselves_and_compute_the_same(checkpoint):
    """The quantization / sharding seam: a different Linear storage needs no loader change."""
    plain = load_model(checkpoint, dtype=torch.float32).model
    swapped_count = []
    swapped = load_model(
        checkpoint, dtype=torch.float32,
        transform=lambda m: swapped_count.append(swap_linears(m, lambda name, linear: TransposedLinear(linear))),
    ).model
    assert swapped_count[0] > 0 and not any(isinstance(m, Linear) for m in swapped.modules())
    tokens = list(range(20, 60))
    torch.testing.assert_close(ForcedRun.of(swapped).logits(tokens, 16), ForcedRun.of(plain).logits(tokens, 16), rtol=1e-5, atol=1e-5)
