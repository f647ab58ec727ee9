"""The embedded default model: HF-loadable, deterministic, correctly sharded, atomically cached."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

import oxserve.default_model as dm
from oxserve.default_model import build
from oxserve.tokenizer import Tokenizer as OxTokenizer

# Tiny but complete: 3 KDA layers + 1 MLA/DSA layer, a dense layer and MoE layers.
TINY = dm.make_text_config(
    vocab_size=8192,
    hidden_size=64,
    num_hidden_layers=4,
    intermediate_size=96,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=8,
    index_kpool=4,
    linear_num_heads=2,
    linear_head_dim=16,
)
# The other branches: attention biases, a "shared" indexer layer, an unbounded forget gate.
TINY_VARIANT = {
    **TINY,
    "layer_types": ["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
    "indexer_types": ["full", "full", "shared", "full"],
    "attention_bias": True,
    "linear_lower_bound": None,
}


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def read_bytes(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir())}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build.build_checkpoint(tmp_path_factory.mktemp("tiny"), TINY)


# ---- loads in the HF reference ---------------------------------------------------------


RENAMES = {
    "hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale",
    "self_attn.f_a_proj": "self_attn.forget_gate.f_a_proj",
    "self_attn.f_b_proj": "self_attn.forget_gate.f_b_proj",
    "self_attn.dt_bias": "self_attn.forget_gate.dt_bias",
    "self_attn.A_log": "self_attn.forget_gate.A_log",
}  # fmt: skip


def hf_view(state: dict[str, torch.Tensor], name: str) -> tuple[str, torch.Tensor]:
    """The HF parameter (name, values) that holds checkpoint tensor `name`: the conversion
    mapping run forwards (renames, merged experts, concatenated q/k/v convolutions)."""
    for old, new in RENAMES.items():
        name = name.replace(old, new)
    if ".mlp.experts." in name:
        prefix, rest = name.split(".mlp.experts.")
        expert, proj = int(rest.split(".")[0]), rest.split(".")[1]
        if proj == "down_proj":
            return f"{prefix}.mlp.experts.down_proj", state[f"{prefix}.mlp.experts.down_proj"][expert]
        gate, up = state[f"{prefix}.mlp.experts.gate_up_proj"][expert].chunk(2)
        return f"{prefix}.mlp.experts.gate_up_proj", gate if proj == "gate_proj" else up
    if "_conv1d." in name:
        prefix, x = name.split("_conv1d.")[0].rsplit(".", 1)
        q, k, v = state[f"{prefix}.conv1d.weight"].chunk(3)
        return f"{prefix}.conv1d.weight", {"q": q, "k": k, "v": v}[x]
    return name, state[name]


@pytest.mark.parametrize("text", [TINY, TINY_VARIANT], ids=["tiny", "variant"])
def test_loads_in_hf_with_identical_weights(tmp_path, text):
    from transformers import Glm5NextForConditionalGeneration

    model_dir = build.build_checkpoint(tmp_path, text, seed=3, tokenizer=False)
    model, info = Glm5NextForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]

    state = model.state_dict()
    saved = read_tensors(model_dir)
    keep_fp32 = model._keep_in_fp32_modules_strict
    for name, tensor in saved.items():
        hf_name, hf = hf_view(state, name)
        assert torch.equal(tensor.float(), hf), name
        kept_fp32 = any(k in hf_name for k in keep_fp32)
        assert tensor.dtype == (torch.float32 if kept_fp32 else torch.bfloat16), name
    # Each saved tensor matched its own slice of HF state; equal totals leave no HF value uncovered.
    assert sum(t.numel() for t in saved.values()) == sum(t.numel() for t in state.values())

    with torch.no_grad():
        logits = model(input_ids=torch.arange(20, 36)[None]).logits
    assert logits.isfinite().all() and 0.05 < logits.std() < 5.0


def test_init_follows_hf_semantics(tiny_dir):
    t = read_tensors(tiny_dir)
    layer, moe, mla = (f"model.language_model.layers.{i}" for i in ("0.", "1.mlp.", "3."))
    assert abs(t["lm_head.weight"].float().std() - 0.02) < 1e-3
    assert not t["model.language_model.embed_tokens.weight"][TINY["pad_token_id"]].any()
    assert (t[layer + "input_layernorm.weight"] == 1).all()
    assert (t[layer + "hc_attn_base"] == 0).all() and (t[layer + "hc_attn_scale"] == 1).all()
    assert (t[layer + "self_attn.A_log"] == 0).all()  # linear_lower_bound is set
    dt = torch.nn.functional.softplus(t[layer + "self_attn.dt_bias"])
    assert ((dt > 0.99e-3) & (dt < 1.01e-1)).all()
    assert t[layer + "self_attn.q_conv1d.weight"].abs().max() <= 0.5  # 1/sqrt(kernel 4)
    assert (t[moe + "gate.e_score_correction_bias"] == 0).all()
    assert (t[mla + "self_attn.indexer.index_kpool_compress_ape"] == 0).all()
    assert (t[mla + "self_attn.indexer.index_kpool_compress_gate"] == 1).all()


# ---- determinism and sharding ----------------------------------------------------------


def test_same_seed_same_bytes_different_seed_different_weights(tmp_path, tiny_dir):
    again = build.build_checkpoint(tmp_path / "again", TINY)
    other = build.build_checkpoint(tmp_path / "other", TINY, seed=1, tokenizer=False)
    assert read_bytes(again) == read_bytes(tiny_dir)

    base, changed = read_tensors(tiny_dir), read_tensors(other)
    assert base.keys() == changed.keys()
    assert not torch.equal(base["lm_head.weight"], changed["lm_head.weight"])
    assert (other / "config.json").read_text() == (tiny_dir / "config.json").read_text()


def test_sharded_output_has_a_correct_index(tmp_path, tiny_dir):
    limit = 300_000
    model_dir = build.build_checkpoint(tmp_path, TINY, max_shard_bytes=limit, tokenizer=False)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted(model_dir.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (model_dir / "model.safetensors").exists()
    assert {s.name for s in shards} == set(index["weight_map"].values())

    whole, total_size = read_tensors(tiny_dir), 0
    for shard in shards:
        with safe_open(shard, "pt") as f:
            names = list(f.keys())
            tensors = [f.get_tensor(n) for n in names]
        size = sum(t.numel() * t.element_size() for t in tensors)
        assert size <= limit or len(tensors) == 1
        assert all(index["weight_map"][n] == shard.name for n in names)
        assert all(torch.equal(t, whole[n]) for n, t in zip(names, tensors))
        total_size += size
    assert index["weight_map"].keys() == whole.keys()
    assert index["metadata"] == {
        "total_size": total_size,
        "total_parameters": sum(t.numel() for t in whole.values()),
    }


def test_small_config_is_about_92m_parameters(tmp_path):
    specs = build.tensor_specs(build.model_config(dm.SMALL_TEXT_CONFIG, torch.bfloat16))
    assert 90e6 < sum(s.numel for s in specs) < 93e6
    model_dir = build.build_checkpoint(tmp_path, tokenizer=False)
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        assert set(f.keys()) == {s.name for s in specs}
    text = json.loads((model_dir / "config.json").read_text())["text_config"]
    assert text["layer_types"] == (["linear_attention"] * 3 + ["indexed_attention"]) * 2
    assert text["mlp_layer_types"] == ["dense"] + ["sparse"] * 7


# ---- tokenizer ---------------------------------------------------------------------------


def test_tokenizer_round_trips_and_keeps_special_tokens_whole(tiny_dir):
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == build.TOKENIZER_VOCAB_SIZE <= TINY["vocab_size"]
    for text in [
        "The engine serves tokens quickly.",
        "  two leading spaces,\ttabs\nand\n\nnewlines  ",
        "def f(x):\n    return x * 2  # code\n",
        "naïve café — 東京 🙂 ünïcödé",
        "",
    ]:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    for token, i in dm.TOKEN_IDS.items():
        assert tok.token_to_id(token) == i
        assert tok.encode(f"a {token} b").ids.count(i) == 1
    config = json.loads((tiny_dir / "config.json").read_text())
    text = config["text_config"]
    assert text["eos_token_id"] == dm.TOKEN_IDS["<|endoftext|>"]
    assert text["pad_token_id"] == dm.TOKEN_IDS["<pad>"]
    assert max(config[k] for k in config if k.endswith("token_id")) < text["vocab_size"]
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    stops = ("<|endoftext|>", "<|user|>", "<|observation|>")
    assert generation["eos_token_id"] == [dm.TOKEN_IDS[t] for t in stops]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
          "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]  # fmt: skip
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Ask the tool.",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "warm"},
]  # fmt: skip


def test_chat_template_renders_glm_prompt(tiny_dir):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    expected = "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi!<|assistant|><think>"
    # HF renders chat templates with trim_blocks and lstrip_blocks.
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    assert env.from_string(dm.CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True) == expected
    no_thinking = env.from_string(dm.CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True, enable_thinking=False)
    assert no_thinking == expected.removesuffix("<think>") + "</think>"
    without_prompt = env.from_string(dm.CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=False)
    assert without_prompt == expected.removesuffix("<|assistant|><think>")

    hf = AutoTokenizer.from_pretrained(tiny_dir)
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
    assert (hf.eos_token, hf.pad_token, hf.bos_token) == ("<|endoftext|>", "<pad>", "<sop>")
    ids = hf(expected).input_ids
    assert ids[:3] == [dm.TOKEN_IDS[t] for t in ("[gMASK]", "<sop>", "<|system|>")]
    assert hf.decode(ids) == expected


def test_chat_template_renders_tools_calls_and_results(tiny_dir):
    """GLM's tool conventions: tools in a system turn, calls as <tool_call> markup with string
    values verbatim and others as JSON, consecutive results under one <|observation|>."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_dir)
    text = hf.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("[gMASK]<sop><|system|>\n# Tools")
    assert json.dumps(TOOLS[0]) in text
    assert OxTokenizer(tiny_dir).apply_chat_template(CONVERSATION, tools=TOOLS) == text
    assert text.endswith(
        "<|system|>\nBe brief.<|user|>\nWeather in Paris?<|assistant|><think>Ask the tool.</think>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
        "<|observation|><tool_response>sunny</tool_response><tool_response>warm</tool_response><|assistant|><think>"
    )
    ids = hf(text).input_ids
    for markup in dm.TEXT_MARKUP_TOKENS[:4] + ("<tool_response>",):  # single tokens that decode as text
        assert hf.convert_tokens_to_ids(markup) in ids
        assert markup in hf.decode(ids, skip_special_tokens=True)


def test_tokenizer_training_is_deterministic_across_processes(tiny_dir):
    code = (
        "import sys; from oxserve.default_model.build import train_tokenizer;"
        "sys.stdout.write(train_tokenizer().to_str(pretty=True))"
    )
    fresh = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert fresh == (tiny_dir / "tokenizer.json").read_text()


# ---- the cached default model ------------------------------------------------------------


@pytest.fixture
def fake_builds(monkeypatch):
    """Replaces the real build with a tiny one and records each build's directory."""
    builds: list[Path] = []

    def fake_build(out_dir, text_config=None):
        builds.append(Path(out_dir))
        return build.build_checkpoint(out_dir, TINY, tokenizer=True)

    monkeypatch.setattr(dm, "build_checkpoint", fake_build)
    return builds


def test_random_model_dir_follows_the_env(monkeypatch, tmp_path):
    monkeypatch.setenv("OXSERVE_CACHE_DIR", str(tmp_path))
    assert dm.random_model_dir() == tmp_path / "random-model-v2"
    monkeypatch.delenv("OXSERVE_CACHE_DIR")
    assert dm.random_model_dir() == Path.home() / ".cache" / "oxserve" / "random-model-v2"


def test_ensure_builds_once(monkeypatch, tmp_path, fake_builds):
    monkeypatch.setenv("OXSERVE_CACHE_DIR", str(tmp_path))
    path = dm.ensure_random_model()
    assert path == tmp_path / "random-model-v2" and (path / "config.json").is_file()
    first = read_bytes(path)
    assert dm.ensure_random_model() == path
    assert len(fake_builds) == 1 and read_bytes(path) == first
    assert [p.name for p in tmp_path.iterdir()] == ["random-model-v2"]  # no staging left behind

    dm.ensure_random_model(force=True)
    assert len(fake_builds) == 2 and read_bytes(path) == first
    assert [p.name for p in tmp_path.iterdir()] == ["random-model-v2"]


def test_a_crashed_build_leaves_nothing(monkeypatch, tmp_path):
    def crashing_build(out_dir, text_config=None):
        (Path(out_dir) / "config.json").write_text("{}")
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(dm, "build_checkpoint", crashing_build)
    with pytest.raises(RuntimeError):
        dm.ensure_random_model(tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_a_concurrent_builder_that_finishes_first_wins(monkeypatch, tmp_path):
    target = tmp_path / "model"

    def racing_build(out_dir, text_config=None):
        # While we build, another process publishes a complete model at the target.
        build.build_checkpoint(target, TINY, seed=7)
        return build.build_checkpoint(out_dir, TINY, seed=0)

    monkeypatch.setattr(dm, "build_checkpoint", racing_build)
    assert dm.ensure_random_model(target) == target
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    winner = build.build_checkpoint(tmp_path / "expected", TINY, seed=7)
    assert read_bytes(target) == read_bytes(winner)


def test_cli_prints_the_path(tmp_path, fake_builds, capsys):
    from oxserve.default_model.__main__ import main

    main(["--out", str(tmp_path / "m")])
    main(["--out", str(tmp_path / "m"), "--force"])
    assert capsys.readouterr().out.split() == [str(tmp_path / "m")] * 2
    assert len(fake_builds) == 2


def test_build_command_writes_a_shape_variant(tmp_path):
    """`oxserve build-default-model --set` changes text-config fields; a variant never
    replaces the default model, so it needs its own --out."""
    out = tmp_path / "variant"
    cmd = [sys.executable, "-m", "oxserve.cli", "build-default-model", "--out", str(out),
           "--set", "linear_head_dim=32", "--set", "num_hidden_layers=4", "--set", "linear_lower_bound=null"]
    subprocess.run(cmd, check=True, capture_output=True)
    text = json.loads((out / "config.json").read_text())["text_config"]
    assert (text["linear_head_dim"], text["num_hidden_layers"], text["linear_lower_bound"]) == (32, 4, None)
    assert len(text["layer_types"]) == 4  # schedules follow the new layer count
    refused = subprocess.run([sys.executable, "-m", "oxserve.cli", "build-default-model", "--set", "hidden_size=64"],
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "--out" in refused.stderr
