"""The analytic op costs agree with the real modules' weights, and scale as they should."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TINY_TEXT_CONFIG

from oxserve.model.config import TextModelConfig
from oxserve.model.glm5_next import Glm5NextForCausalLM
from oxserve.profiling.costs import OP_COSTS, StepShape, decode_step_shape, experts_touched, forward_cost, op_cost

CFG = TextModelConfig.from_hf_dict(TINY_TEXT_CONFIG)
NOTHING = StepShape(num_tokens=0, num_requests=0, num_decodes=0, mean_context=0.0, max_context=0)


@pytest.fixture(scope="module")
def params() -> dict[str, int]:
    with torch.device("meta"):
        model = Glm5NextForCausalLM(CFG)  # fp32 parameters: 4 bytes each, like e = 4 below
    return {name: p.numel() * 4 for name, p in model.named_parameters()}


def weights(params: dict[str, int], prefix: str, *names: str) -> int:
    return sum(params[f"{prefix}.{n}"] for n in names)


# op -> (layer, parameters it must read); with no tokens a cost is its weights alone.
WEIGHTS = {
    "kda.qkv_proj": (0, ["self_attn.qkv_proj.weight"]),
    "kda.conv": (0, ["self_attn.conv_weight"]),
    "kda.gates": (0, ["self_attn.forget_gate.f_a_proj.weight", "self_attn.forget_gate.f_b_proj.weight",
                      "self_attn.forget_gate.dt_bias", "self_attn.forget_gate.A_log", "self_attn.b_proj.weight"]),
    "kda.out": (0, ["self_attn.g_a_proj.weight", "self_attn.g_b_proj.weight", "self_attn.o_norm_weight",
                    "self_attn.o_proj.weight"]),
    "mla.kv_proj": (3, ["self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight"]),
    "mla.indexer": (3, ["self_attn.indexer.wq_b.weight", "self_attn.indexer.wk.weight", "self_attn.indexer.k_norm_weight",
                        "self_attn.indexer.k_norm_bias", "self_attn.indexer.weights_proj.weight",
                        "self_attn.indexer.compress_ape", "self_attn.indexer.compress_gate"]),
    "moe.router": (1, ["mlp.gate.weight", "mlp.gate.e_score_correction_bias"]),
    "moe.shared": (1, ["mlp.shared_experts.gate_up_proj.weight", "mlp.shared_experts.down_proj.weight"]),
    "mlp.dense": (0, ["mlp.gate_up_proj.weight", "mlp.down_proj.weight"]),
    "hc.collapse": (0, ["attn_hc.fn", "attn_hc.base", "attn_hc.scale", "input_layernorm.weight"]),
}


@pytest.mark.parametrize("op", sorted(WEIGHTS))
def test_weight_bytes_match_the_modules(op, params):
    layer, names = WEIGHTS[op]
    assert op_cost(op, CFG, NOTHING, 4).bytes == weights(params, f"layers.{layer}", *names)


def test_mla_projections_read_the_folded_kv_b(params):
    """q_proj reads W_uk and o_proj W_uv: together, all of kv_b_proj."""
    p = "layers.3.self_attn"
    q = weights(params, p, "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight")
    o = weights(params, p, "o_proj.weight")
    kv_b = weights(params, p, "kv_b_proj.weight")
    assert op_cost("mla.q_proj", CFG, NOTHING, 4).bytes + op_cost("mla.o_proj", CFG, NOTHING, 4).bytes == q + o + kv_b


def test_lm_head_and_every_op_type_is_modelled(params):
    assert op_cost("lm_head", CFG, NOTHING, 4).bytes == params["lm_head.weight"]
    assert op_cost("L0.unknown", CFG, NOTHING, 4) is None
    assert set(OP_COSTS) >= {"kda.recurrent", "mla.attention", "moe.experts", "embed", "final_norm"}


def test_decode_step_reads_more_experts_as_the_batch_grows():
    assert experts_touched(CFG, 1) == pytest.approx(CFG.num_experts_per_tok)
    assert experts_touched(CFG, 10_000) == pytest.approx(CFG.n_routed_experts)
    one, many = (forward_cost(CFG, decode_step_shape(b, context=64), 2) for b in (1, 64))
    assert many.bytes > one.bytes and many.flops == pytest.approx(64 * one.flops, rel=0.05)


def test_recurrent_state_traffic_is_read_and_write_per_request():
    h, d = CFG.linear_num_heads, CFG.linear_head_dim
    one, two = (op_cost("kda.recurrent", CFG, decode_step_shape(b), 2) for b in (1, 2))
    per_request_state = 2 * h * d * d * 4
    assert two.bytes - one.bytes == pytest.approx(per_request_state + h * (5 * d + 1) * 4)


def test_quantized_storage_counts_int8_weights_and_caches():
    """W8A8 layers read their projection and expert weights in 1 byte; int8/fp8 caches read
    their entries with a per-token scale; the head, router and folded kv_b stay dense."""
    from oxserve.cache.precision import CachePlan, LayerCachePrecision
    from oxserve.profiling.costs import layer_storage

    dense = layer_storage(CFG, torch.float32, set(), CachePlan())
    int8 = layer_storage(CFG, torch.float32, set(range(CFG.num_hidden_layers)),
                         CachePlan(LayerCachePrecision(latent="int8", index_keys="fp8", kda_state="bfloat16")))
    assert op_cost("moe.experts", CFG, NOTHING, int8(1)).bytes * 4 == op_cost("moe.experts", CFG, NOTHING, dense(1)).bytes
    assert op_cost("lm_head", CFG, NOTHING, int8(1)).bytes == op_cost("lm_head", CFG, NOTHING, dense(1)).bytes
    assert op_cost("moe.router", CFG, NOTHING, int8(1)).bytes == op_cost("moe.router", CFG, NOTHING, dense(1)).bytes
    step = decode_step_shape(4, context=64)
    c = CFG.kv_lora_rank
    gathered = 4 * min(64, CFG.index_topk + CFG.index_kpool - 1) * c  # latents the 4 decodes gather
    attn = op_cost("mla.attention", CFG, step, dense(3)).bytes - op_cost("mla.attention", CFG, step, int8(3)).bytes
    assert attn == pytest.approx(gathered * (4 - (1 + 4 / c)))
    h, d = CFG.linear_num_heads, CFG.linear_head_dim
    state = op_cost("kda.recurrent", CFG, step, dense(0)).bytes - op_cost("kda.recurrent", CFG, step, int8(0)).bytes
    assert state == pytest.approx(2 * 4 * h * d * d * 2)
    assert forward_cost(CFG, step, 4, int8).bytes < forward_cost(CFG, step, 4).bytes  # the tiny head dominates


@pytest.mark.parametrize("tokens", [1, 32])
def test_the_spans_of_a_bf16_moe_layer_are_costed_as_all_its_experts(tokens):
    """Where the shared expert runs inside the routed experts' call (CPU panels), that one span
    is costed as both: the profile must not charge shared-expert time to the routed experts."""
    from oxserve.model.moe import MoE
    from oxserve.profiling.spans import OpSpan
    from oxserve.telemetry import Tracer

    layer = MoE(CFG, "L1.moe")
    for name, p in layer.named_parameters():  # a bf16 model; the router's bias stays fp32
        p.data = (torch.randn_like(p, dtype=torch.float32) * 0.1).to(torch.float32 if "bias" in name else torch.bfloat16)
    for module in reversed(list(layer.modules())):
        if hasattr(module, "after_load"):
            module.after_load()
    tracer = Tracer()
    layer(torch.randn(tokens, CFG.hidden_size).bfloat16(), tracer)
    shape = StepShape(num_tokens=tokens, num_requests=tokens, num_decodes=tokens, mean_context=1.0, max_context=1)
    costs = [op_cost(OpSpan(s.name, 0.0, 0.0).op_type, CFG, shape, 2) for s in tracer.spans]
    assert None not in costs
    want = [op_cost(op, CFG, shape, 2) for op in ("moe.router", "moe.experts", "moe.shared")]
    assert sum(c.flops for c in costs) == sum(c.flops for c in want)
    assert sum(c.bytes for c in costs) == sum(c.bytes for c in want)
