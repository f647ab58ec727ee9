"""Analytic bytes and FLOPs of every model op, from the model config and a step's conditions.

These are *minimum* costs: every weight the op needs is read once, every activation is
read and written once, per-request state is read and written once. What an implementation
moves beyond that (temporaries, fp32 copies of bf16 weights, re-gathers) is exactly what
the roofline fraction exposes, so none of it is counted here.

Notation (all per layer, per forward pass):

    T  tokens          R  requests          Rd decodes (1 token each)      Rp = R - Rd
    Tp = T - Rd  prefill tokens             c  context a query sees (tokens, see below)
    e  bytes per model-dtype element        fp32 state and gates: 4 bytes
    h  hidden   n  mHC streams   H, dk, dv  KDA heads and head dims   kd = H*dk
    nH MLA heads   C kv_lora_rank   qr q_lora_rank   P index_kpool
    E  routed experts   k experts per token   I moe_intermediate_size

Context: the runner records only each step's mean and max sequence length. A decode query
sees `mean_context` tokens; a prefill query sees half of it on average (causal). Attention
and indexer costs are therefore estimates; the matmul ops (most of a step) are exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from oxserve.model.config import TextModelConfig

FP32 = 4


@dataclass(frozen=True)
class StepShape:
    """What one forward pass processed (the `forward` span's args)."""

    num_tokens: int
    num_requests: int
    num_decodes: int
    mean_context: float  # mean sequence length after the step
    max_context: int

    @property
    def num_prefills(self) -> int:
        return self.num_requests - self.num_decodes

    @property
    def prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decodes

    @property
    def phase(self) -> str:
        if self.num_prefills == 0:
            return "decode"
        return "prefill" if self.num_decodes == 0 else "mixed"

    @classmethod
    def from_args(cls, args: dict) -> StepShape:
        return cls(
            num_tokens=int(args["num_tokens"]), num_requests=int(args["num_requests"]),
            num_decodes=int(args["num_decodes"]), mean_context=float(args["mean_context"]),
            max_context=int(args["max_context"]),
        )


@dataclass(frozen=True)
class Cost:
    bytes: float
    flops: float
    precision: str  # which matmul peak bounds the FLOPs: "fp32" or "bf16"

    def __add__(self, other: Cost) -> Cost:
        # A sum stays a lower bound only if all its FLOPs are charged at the faster peak.
        precision = "bf16" if "bf16" in (self.precision, other.precision) else "fp32"
        return Cost(self.bytes + other.bytes, self.flops + other.flops, precision)


def _dtype_precision(e: int) -> str:
    return "fp32" if e >= FP32 else "bf16"


# ---- per-op formulas -------------------------------------------------------------------
# Each takes (cfg, shape, e) and returns Cost. Keys are op types: span names without "L{i}.".


def _embed(cfg, s, e):
    return Cost(s.num_tokens * cfg.hidden_size * e * (1 + cfg.hc_mult), 0.0, _dtype_precision(e))


def _hc_collapse(cfg, s, e):
    # Includes the block's input RMSNorm. Projection of the flattened streams runs in fp32.
    t, n, h = s.num_tokens, cfg.hc_mult, cfg.hidden_size
    weights = (2 + n) * n * n * h * e + ((2 + n) * n + 3) * FP32 + h * e  # fn, base, scale, norm
    data = t * n * h * e + t * h * e
    flops = 2 * t * n * h * (2 + n) * n + 2 * t * n * h + t * cfg.hc_sinkhorn_iters * 4 * n * n + 4 * t * h
    return Cost(weights + data, flops, "fp32")


def _hc_expand(cfg, s, e):
    t, n, h = s.num_tokens, cfg.hc_mult, cfg.hidden_size
    return Cost((2 * t * n * h + t * h) * e, t * n * h * (2 * n + 2), _dtype_precision(e))


def _linear(t: int, d_in: int, d_out: int, e: int) -> tuple[float, float]:
    """(bytes, flops) of x[t, d_in] @ W[d_out, d_in]^T: weight + input + output once."""
    return (d_in * d_out + t * d_in + t * d_out) * e, 2.0 * t * d_in * d_out


def _kda_qkv_proj(cfg, s, e):
    b, f = _linear(s.num_tokens, cfg.hidden_size, 3 * cfg.kda_dim, e)
    return Cost(b, f, _dtype_precision(e))


def _kda_conv(cfg, s, e):
    ch, k = 3 * cfg.kda_dim, cfg.linear_conv_kernel_dim
    state = 2 * s.num_requests * (k - 1) * ch * e  # read + write the last k-1 inputs
    return Cost(state + ch * k * FP32 + 2 * s.num_tokens * ch * e, 2.0 * s.num_tokens * ch * k, "fp32")


def _kda_gates(cfg, s, e):
    t, h, dk, kd, heads = s.num_tokens, cfg.hidden_size, cfg.linear_head_dim, cfg.kda_dim, cfg.linear_num_heads
    weights = (h * dk + dk * kd + h * heads) * e + (kd + heads) * FP32  # + dt_bias, A_log
    data = t * (3 * kd + h) * e + t * (4 * kd + heads) * FP32  # in: conv out, x; out: q, k, v, g, beta
    flops = 2.0 * t * (h * dk + dk * kd + h * heads) + 12.0 * t * kd  # + l2norms, softplus/sigmoid
    return Cost(weights + data, flops, _dtype_precision(e))


def _kda_recurrent(cfg, s, e):
    heads, dk, dv = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_head_dim
    state = heads * dk * dv * FP32
    data = s.num_tokens * heads * (3 * dk + 2 * dv + 1) * FP32  # q, k, g, v in; o out; beta
    # The delta rule's own work per token and state element: decay (1), k.S (2), rank-1
    # update (2), q.S (2). Chunked prefill does more to run in parallel; that is overhead.
    flops = 7.0 * s.num_tokens * heads * dk * dv
    return Cost(2 * s.num_requests * state + data, flops, "fp32")


def _kda_out(cfg, s, e):
    t, h, dk, kd = s.num_tokens, cfg.hidden_size, cfg.linear_head_dim, cfg.kda_dim
    weights = (h * dk + dk * kd + kd * h + dk) * e
    data = t * kd * FP32 + 2 * t * h * e
    return Cost(weights + data, 2.0 * t * (h * dk + dk * kd + kd * h) + 6.0 * t * kd, _dtype_precision(e))


def _mla_q_proj(cfg, s, e):
    t, h, qr = s.num_tokens, cfg.hidden_size, cfg.q_lora_rank
    nope, heads, c = cfg.qk_nope_head_dim, cfg.num_attention_heads, cfg.kv_lora_rank
    weights = (h * qr + qr * heads * nope + heads * nope * c + qr) * e  # q_a, q_b, W_uk, norm
    data = t * (h + heads * c) * e
    return Cost(weights + data, 2.0 * t * (h * qr + qr * heads * nope + heads * nope * c), _dtype_precision(e))


def _mla_kv_proj(cfg, s, e):
    b, f = _linear(s.num_tokens, cfg.hidden_size, cfg.kv_lora_rank, e)
    return Cost(b + cfg.kv_lora_rank * e, f, _dtype_precision(e))


def _query_contexts(s: StepShape) -> tuple[float, float]:
    """(tokens a decode query sees, tokens a prefill query sees on average)."""
    return s.mean_context, s.mean_context / 2


def _mla_indexer(cfg, s, e):
    t, h, qr = s.num_tokens, cfg.hidden_size, cfg.q_lora_rank
    ih, nih, pool = cfg.index_head_dim, cfg.index_n_heads, cfg.index_kpool
    weights = (2 * h * ih + qr * nih * ih + h * nih + 2 * ih + pool * ih) * e
    keys_written = t * 2 * ih * e
    c_dec, c_pre = _query_contexts(s)
    # Decodes read their own pool keys; a prompt's queries share one read of its pool keys.
    pool_reads = (s.num_decodes * c_dec + s.num_prefills * s.max_context) / pool * ih * e
    scored = (s.num_decodes * c_dec + s.prefill_tokens * c_pre) / pool  # pools scored, all queries
    flops = 2.0 * t * (2 * h * ih + qr * nih * ih + h * nih) + scored * nih * (2 * ih + 2)
    return Cost(weights + keys_written + pool_reads + t * (h + qr) * e, flops, _dtype_precision(e))


def _mla_attention(cfg, s, e):
    c, heads = cfg.kv_lora_rank, cfg.num_attention_heads
    cap = cfg.index_topk + cfg.index_kpool - 1  # DSA bound on positions per query
    c_dec, c_pre = _query_contexts(s)
    k_dec, k_pre = min(c_dec, cap), min(c_pre, cap)
    # Decodes gather their selected latents; a prompt reads each of its latents once.
    latents = (s.num_decodes * k_dec + s.num_prefills * min(s.max_context, s.mean_context)) * c * e
    data = 2 * s.num_tokens * heads * c * e  # q_latent in, latent output out
    flops = 4.0 * heads * c * (s.num_decodes * k_dec + s.prefill_tokens * k_pre)
    return Cost(latents + data, flops, _dtype_precision(e))


def _mla_o_proj(cfg, s, e):
    t, heads, v, c, h = s.num_tokens, cfg.num_attention_heads, cfg.v_head_dim, cfg.kv_lora_rank, cfg.hidden_size
    weights = (heads * v * c + heads * v * h) * e  # W_uv, o_proj
    data = t * (heads * c + h) * e
    return Cost(weights + data, 2.0 * t * (heads * v * c + heads * v * h), _dtype_precision(e))


def _moe_router(cfg, s, e):
    t, h, n_exp = s.num_tokens, cfg.hidden_size, cfg.n_routed_experts
    data = n_exp * h * e + n_exp * FP32 + t * h * e + t * cfg.num_experts_per_tok * 2 * FP32
    return Cost(data, 2.0 * t * h * n_exp, "fp32")


def experts_touched(cfg: TextModelConfig, tokens: int) -> float:
    """Expected distinct routed experts for `tokens` tokens, routing uniform at random."""
    n_exp, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return n_exp * (1.0 - (1.0 - k / n_exp) ** tokens)


def _moe_experts(cfg, s, e):
    t, h, inter, k = s.num_tokens, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    weights = experts_touched(cfg, t) * 3 * h * inter * e
    data = 2 * t * h * e + t * k * FP32
    return Cost(weights + data, 2.0 * t * k * 3 * h * inter, _dtype_precision(e))


def _dense_mlp(t: int, h: int, inter: int, e: int) -> tuple[float, float]:
    return (3 * h * inter + 2 * t * h) * e, 2.0 * t * 3 * h * inter


def _moe_shared(cfg, s, e):
    b, f = _dense_mlp(s.num_tokens, cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, e)
    return Cost(b, f, _dtype_precision(e))


def _mlp_dense(cfg, s, e):
    b, f = _dense_mlp(s.num_tokens, cfg.hidden_size, cfg.intermediate_size, e)
    return Cost(b, f, _dtype_precision(e))


def _final_norm(cfg, s, e):
    # Rows with logits: about one per request (a prompt chunk that does not finish has none).
    rows = s.num_requests
    return Cost(rows * cfg.hidden_size * (cfg.hc_mult + 1) * e, 4.0 * rows * cfg.hidden_size * cfg.hc_mult, _dtype_precision(e))


def _lm_head(cfg, s, e):
    rows, h, v = s.num_requests, cfg.hidden_size, cfg.vocab_size
    return Cost(v * h * e + rows * h * e + rows * v * FP32, 2.0 * rows * h * v, _dtype_precision(e))


OP_COSTS: dict[str, Callable[[TextModelConfig, StepShape, int], Cost]] = {
    "embed": _embed,
    "hc.collapse": _hc_collapse,
    "hc.expand": _hc_expand,
    "kda.qkv_proj": _kda_qkv_proj,
    "kda.conv": _kda_conv,
    "kda.gates": _kda_gates,
    "kda.recurrent": _kda_recurrent,
    "kda.out": _kda_out,
    "mla.q_proj": _mla_q_proj,
    "mla.kv_proj": _mla_kv_proj,
    "mla.indexer": _mla_indexer,
    "mla.attention": _mla_attention,
    "mla.o_proj": _mla_o_proj,
    "moe.router": _moe_router,
    "moe.experts": _moe_experts,
    "moe.shared": _moe_shared,
    "mlp.dense": _mlp_dense,
    "final_norm": _final_norm,
    "lm_head": _lm_head,
}


def op_cost(op: str, cfg: TextModelConfig, shape: StepShape, elem_bytes: int) -> Cost | None:
    """Cost of one call of op type `op` (e.g. "kda.recurrent"); None for ops not modelled."""
    fn = OP_COSTS.get(op)
    return None if fn is None else fn(cfg, shape, elem_bytes)


def layer_ops(cfg: TextModelConfig, index: int) -> list[str]:
    """The op types layer `index` runs, each hc op twice (attention and FFN halves)."""
    attn = ["kda.qkv_proj", "kda.conv", "kda.gates", "kda.recurrent", "kda.out"]
    if cfg.is_mla_layer(index):
        attn = ["mla.q_proj", "mla.kv_proj"] + (["mla.indexer"] if cfg.is_full_indexer_layer(index) else [])
        attn += ["mla.attention", "mla.o_proj"]
    ffn = ["moe.router", "moe.experts", "moe.shared"] if cfg.mlp_layer_types[index] == "sparse" else ["mlp.dense"]
    return ["hc.collapse", "hc.expand"] * 2 + attn + ffn


def forward_cost(cfg: TextModelConfig, shape: StepShape, elem_bytes: int) -> Cost:
    """Minimum cost of a whole forward pass (embedding to logits)."""
    ops = ["embed", "final_norm", "lm_head"]
    for i in range(cfg.num_hidden_layers):
        ops += layer_ops(cfg, i)
    total = Cost(0.0, 0.0, _dtype_precision(elem_bytes))
    for op in ops:
        total = total + OP_COSTS[op](cfg, shape, elem_bytes)
    return total


def decode_step_shape(batch: int, context: int = 1) -> StepShape:
    return StepShape(num_tokens=batch, num_requests=batch, num_decodes=batch, mean_context=context, max_context=context)
