"""Mixed-precision caches: int8 / fp8 paged tables against plain dequantized maths, the
bytes the planner counts, the accuracy loss as a number, and per-layer plans."""

from __future__ import annotations

import pytest
import torch

from oxserve.cache.layers import FP8, ScaledRows
from oxserve.cache.precision import CachePlan, LayerCachePrecision
from oxserve.cache.spec import bytes_per_token
from oxserve.model.forced import forced_logits
from oxserve.model.loader import load_model
from oxserve.quantization.plan import QuantizationPlan
from oxserve.quantization.quality import agreement


@pytest.mark.parametrize("dtype, rel", [(torch.int8, 0.5 / 127), (FP8, 1 / 16)])
def test_scaled_rows_round_trip_within_one_step(dtype, rel):
    table = ScaledRows.zeros(40, 24, dtype, torch.float32, "cpu")
    x = torch.randn(6, 24) * torch.logspace(-3, 3, 6)[:, None]
    x[2] = 0.0
    rows = torch.tensor([3, 39, 0, 17, 8, 21])
    table.store(rows, x)
    back = table.gather(rows.view(2, 3)).view(6, 24)
    amax = x.abs().amax(-1, keepdim=True)
    if dtype == torch.int8:
        assert ((back - x).abs() <= amax * rel * 1.0001).all()
    else:  # e4m3: 3 mantissa bits, relative error at most 2^-4 above the subnormals
        assert ((back - x).abs() <= x.abs() * rel + amax / 448 * 2**-6).all()
    assert torch.equal(back[2], torch.zeros(24))
    assert table.values.dtype == (torch.int8 if dtype == torch.int8 else torch.uint8)


def test_int8_latents_take_half_the_bytes(tiny_model_dir):
    from oxserve.default_model import default_model

    model = load_model(default_model(), dtype=torch.bfloat16).model
    def latents(kv: str) -> list:
        specs = model.cache_specs(torch.bfloat16, CachePlan(LayerCachePrecision(latent=kv, index_keys=kv)))
        return [s.latent for s in specs if hasattr(s, "latent")]
    bf16 = sum(t.bytes_per_token for t in latents("auto"))
    scales = 4 * len(latents("auto"))  # one fp32 scale per token and layer
    for kv in ("int8", "fp8"):
        assert sum(t.bytes_per_token for t in latents(kv)) == bf16 / 2 + scales
    specs = model.cache_specs(torch.bfloat16, CachePlan(LayerCachePrecision(latent="int8", index_keys="int8")))
    assert bytes_per_token(specs) < bytes_per_token(model.cache_specs(torch.bfloat16))


@pytest.mark.parametrize("precision", [
    LayerCachePrecision(latent="int8", index_keys="int8"),
    LayerCachePrecision(latent="fp8", index_keys="fp8"),
    LayerCachePrecision(kda_state="bfloat16"),
    LayerCachePrecision(kda_conv="bfloat16"),
], ids=["int8", "fp8", "kda-bf16", "conv-bf16"])
def test_quantized_caches_stay_within_the_budget(precision):
    """Teacher-forced on held-out code through the trained default model, prefilled in chunks
    and then decoded, so that attention and the indexer read what earlier steps stored: mean
    KL within 0.01 nats/token and top-1 agreement >= 99%, the quantization issue's bounds."""
    from oxserve.default_model import default_model
    from oxserve.default_model.train import held_out_windows

    model = load_model(default_model(), dtype=torch.float32).model
    plan = CachePlan(precision)
    seqs = held_out_windows(default_model(), 3, 160, int(torch.randint(0, 2**31, ())))
    ref = [forced_logits(model, s, 48, decode_from=len(s) - 16) for s in seqs]
    got = [forced_logits(model, s, 48, decode_from=len(s) - 16, cache_plan=plan) for s in seqs]
    result = agreement(ref, got)
    print(f"caches {precision}: {result}")
    assert result.mean_kl <= 0.01 and result.top1 >= 0.99
    assert result.mean_kl > 0  # the plan did change the storage


def test_engine_holds_more_blocks_in_the_same_memory():
    from oxserve.engine.engine import LLMEngine
    from oxserve.options import engine_config

    def blocks(**options) -> int:
        engine = LLMEngine(engine_config({"dtype": "float32", "cache_memory_gib": 0.1, **options}))
        return engine.runner.layout.num_blocks
    assert blocks(kv_cache_dtype="int8") > 1.5 * blocks()


def test_plan_file_sets_layers_and_is_validated(tmp_path):
    plan = QuantizationPlan({0: {"weights": "none", "kda_state": "bfloat16"}, 3: {"latent": "fp8"}})
    path = tmp_path / "plan.yaml"
    plan.dump(path, "a test plan")
    loaded = QuantizationPlan.load(path)
    assert loaded == plan
    cache = loaded.cache_plan(LayerCachePrecision(latent="int8", index_keys="int8"))
    assert cache.for_layer(3) == LayerCachePrecision(latent="fp8", index_keys="int8")
    assert cache.for_layer(0).kda_state == "bfloat16" and cache.for_layer(1).latent == "int8"
    with pytest.raises(ValueError, match="unknown key 'latnet'"):
        QuantizationPlan({1: {"latnet": "int8"}})
    with pytest.raises(ValueError, match="latent='int4'"):
        QuantizationPlan({1: {"latent": "int4"}})
    with pytest.raises(ValueError, match="weights='int4'"):
        QuantizationPlan({1: {"weights": "int4"}})


@pytest.mark.slow
def test_sensitivity_command_writes_a_plan_the_engine_serves(tiny_model_dir, tmp_path, capsys):
    """The whole command on the tiny model: per-layer table, a plan whose verified KL is within
    the budget, and an engine started from that plan has exactly its modules and caches."""
    from oxserve.cli import main
    from oxserve.engine.engine import LLMEngine
    from oxserve.options import engine_config
    from oxserve.quantization.w8a8 import W8A8Linear

    out = tmp_path / "plan"
    args = ["quantize", "sensitivity", "--model", str(tiny_model_dir), "--dtype", "float32", "--sequences", "2",
            "--held-out", "2", "--length", "48", "--kl-budget", "2e-5", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| layer | component |" in printed and (out / "sensitivity.png").stat().st_size > 1000
    verified = float(printed.split("verified: mean KL ")[1].split()[0])
    assert verified <= 2e-5
    plan = QuantizationPlan.load(out / "plan.yaml")
    assert len(plan.layers) == 4
    engine = LLMEngine(engine_config({"model": str(tiny_model_dir), "dtype": "float32", "quantization_plan": str(out / "plan.yaml")}))
    model = engine.runner.model
    for i, entry in plan.layers.items():
        quantized = isinstance(model.layers[i].mlp.gate_up_proj if hasattr(model.layers[i].mlp, "gate_up_proj")
                               else model.layers[i].mlp.shared_experts.gate_up_proj, W8A8Linear)
        assert quantized == (entry["weights"] == "w8a8")
        assert engine.cache_plan.for_layer(i).latent == entry.get("latent", "auto")
    # A budget of zero leaves everything in high precision.
    assert main([*args[:-4], "--kl-budget", "0", "--out", str(tmp_path / "none")]) == 0
    assert all(e == {"weights": "none"} for e in QuantizationPlan.load(tmp_path / "none" / "plan.yaml").layers.values())
