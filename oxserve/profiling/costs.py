"""Analytic bytes and FLOPs of every model op, from the model config and a step's conditions.

These are *minimum* costs: every weight the op needs is read once, every activation is
read and written once, per-request state is read and written once. What an implementation
moves beyond that (temporaries, fp32 copies of bf16 weights, re-gathers) is exactly what
the roofline fraction exposes, so none of it is counted here.

Notation (all per layer, per forward pass):

    T  tokens          R  requests          Rd decodes (1 token each)      Rp = R - Rd
    Tp = T - Rd  prefill tokens             c  context a query sees (tokens, see below)
    e  bytes per model-dtype element        fp32 gates: 4 bytes
    w  bytes per element of the weights W8A8 quantizes (projections, experts); 1 if int8
    st, lat, key, conv  bytes per element of the KDA state, MLA latent, DSA keys, KDA conv state as stored
    h  hidden   n  mHC streams   H, dk, dv  KDA heads and head dims   kd = H*dk
    nH MLA heads   C kv_lora_rank   qr q_lora_rank   P index_kpool
    E  routed experts   k experts per token   I moe_intermediate_size

Every formula takes a `Storage` (b): b.e, b.w, b.st, b.lat, b.key, b.conv above. int8 weights'
per-channel scales are not counted (4 bytes per row of K >= 512 elements: < 1%); int8/fp8
cache entries count their per-token scale, amortized over the entry's width.

Context: the runner records only each step's mean and max sequence length. A decode query
sees `mean_context` tokens; a prefill query sees half of it on average (causal). Attention
and indexer costs are therefore estimates; the matmul ops (most of a step) are exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from oxserve.cache.layers import QMAX
from oxserve.cache.precision import CachePlan
from oxserve.cache.spec import itemsize
from oxserve.model.config import TextModelConfig

FP32 = 4


@dataclass(frozen=True)
class Storage:
    """Bytes per element of what one layer's ops read (see the notation above)."""

    e: float  # activations and everything kept in the model's dtype
    w: float  # projection and expert weights (1 when W8A8)
    st: float  # KDA recurrent state
    lat: float  # MLA latents
    key: float  # DSA token and pool keys
    conv: float  # KDA conv state
    replay: int = 0  # KDA decode: ReplaySSM ring length (0: write-back)

    @classmethod
    def dense(cls, e: float) -> Storage:
        return cls(e, e, FP32, e, e, e)

    def precision(self) -> str:
        # The machine ceilings have no int8 peak: W8A8 products are charged at the model
        # dtype's (on the AVX2 machines int8 multiply-adds run at about the fp32 FMA rate).
        return _dtype_precision(self.e)


@dataclass(frozen=True)
class StepShape:
    """What one forward pass processed (the `forward` span's args)."""

    num_tokens: int
    num_requests: int
    num_decodes: int
    mean_context: float  # mean sequence length after the step
    max_context: int
    num_verifies: int = 0  # requests verifying drafts (a token and its drafts each), among the prefills

    @property
    def capturable(self) -> bool:
        """Decodes and verifies only: a pass that captured decode steps take."""
        return self.num_decodes + self.num_verifies == self.num_requests

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
            max_context=int(args["max_context"]), num_verifies=int(args.get("num_verifies", 0)),
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


def _dtype_precision(e: float) -> str:
    return "fp32" if e >= FP32 else "bf16"


# ---- per-op formulas -------------------------------------------------------------------
# Each takes (cfg, shape, b: Storage) and returns Cost. Keys are op types: span names without "L{i}.".


def _embed(cfg, s, b):
    return Cost(s.num_tokens * cfg.hidden_size * b.e * (1 + cfg.hc_mult), 0.0, _dtype_precision(b.e))


def _hc_collapse(cfg, s, b):
    # Includes the block's input RMSNorm. Projection of the flattened streams runs in fp32.
    t, n, h = s.num_tokens, cfg.hc_mult, cfg.hidden_size
    weights = (2 + n) * n * n * h * b.e + ((2 + n) * n + 3) * FP32 + h * b.e  # fn, base, scale, norm
    data = t * n * h * b.e + t * h * b.e
    flops = 2 * t * n * h * (2 + n) * n + 2 * t * n * h + t * cfg.hc_sinkhorn_iters * 4 * n * n + 4 * t * h
    return Cost(weights + data, flops, "fp32")


def _hc_expand(cfg, s, b):
    t, n, h = s.num_tokens, cfg.hc_mult, cfg.hidden_size
    return Cost((2 * t * n * h + t * h) * b.e, t * n * h * (2 * n + 2), _dtype_precision(b.e))


def _linear(t: int, d_in: int, d_out: int, b: Storage) -> tuple[float, float]:
    """(bytes, flops) of x[t, d_in] @ W[d_out, d_in]^T: weight + input + output once."""
    return d_in * d_out * b.w + (t * d_in + t * d_out) * b.e, 2.0 * t * d_in * d_out


def _kda_qkv_proj(cfg, s, b):
    nbytes, f = _linear(s.num_tokens, cfg.hidden_size, 3 * cfg.kda_dim, b)
    return Cost(nbytes, f, b.precision())


def _kda_conv(cfg, s, b):
    ch, k = 3 * cfg.kda_dim, cfg.linear_conv_kernel_dim
    state = 2 * s.num_requests * (k - 1) * ch * b.conv  # read + write the last k-1 inputs
    return Cost(state + ch * k * FP32 + 2 * s.num_tokens * ch * b.e, 2.0 * s.num_tokens * ch * k, "fp32")


def _kda_gates(cfg, s, b):
    t, h, dk, kd, heads = s.num_tokens, cfg.hidden_size, cfg.linear_head_dim, cfg.kda_dim, cfg.linear_num_heads
    weights = (h * dk + dk * kd + h * heads) * b.w + (kd + heads) * FP32  # + dt_bias, A_log
    data = t * (3 * kd + h) * b.e + t * (4 * kd + heads) * FP32  # in: conv out, x; out: q, k, v, g, beta
    flops = 2.0 * t * (h * dk + dk * kd + h * heads) + 12.0 * t * kd  # + l2norms, softplus/sigmoid
    return Cost(weights + data, flops, b.precision())


def _kda_recurrent(cfg, s, b):
    heads, dk, dv = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_head_dim
    state = heads * dk * dv * b.st
    data = s.num_tokens * heads * (3 * dk + 2 * dv + 1) * FP32  # q, k, g, v in; o out; beta
    # The delta rule's own work per token and state element: decay (1), k.S (2), rank-1
    # update (2), q.S (2). Chunked prefill does more to run in parallel; that is overhead.
    flops = 7.0 * s.num_tokens * heads * dk * dv
    states = 2 * s.num_requests * state  # read and written back
    if b.replay:
        # ReplaySSM decodes read the checkpoint once and a fold (read + write) every R steps;
        # the ring: on average (R-1)/2 live entries' keys and deltas read, one entry written,
        # and each entry read once more by its fold.
        ring = b.replay
        per_decode = state * (1 + 2 / ring) + heads * FP32 * ((ring - 1) / 2 * (dk + dv) + (2 * dk + dv) + (dk + dv))
        states += s.num_decodes * (per_decode - 2 * state)
    return Cost(states + data, flops, "fp32")


def _kda_out(cfg, s, b):
    t, h, dk, kd = s.num_tokens, cfg.hidden_size, cfg.linear_head_dim, cfg.kda_dim
    weights = (h * dk + dk * kd + kd * h) * b.w + dk * b.e  # g_a, g_b, o_proj; o_norm
    data = t * kd * FP32 + 2 * t * h * b.e
    return Cost(weights + data, 2.0 * t * (h * dk + dk * kd + kd * h) + 6.0 * t * kd, b.precision())


def _mla_q_proj(cfg, s, b):
    t, h, qr = s.num_tokens, cfg.hidden_size, cfg.q_lora_rank
    nope, heads, c = cfg.qk_nope_head_dim, cfg.num_attention_heads, cfg.kv_lora_rank
    weights = (h * qr + qr * heads * nope) * b.w + (heads * nope * c + qr) * b.e  # q_a, q_b; W_uk (folded), norm
    data = t * (h + heads * c) * b.e
    return Cost(weights + data, 2.0 * t * (h * qr + qr * heads * nope + heads * nope * c), b.precision())


def _mla_kv_proj(cfg, s, b):
    nbytes, f = _linear(s.num_tokens, cfg.hidden_size, cfg.kv_lora_rank, b)
    # The latent is written as the cache stores it.
    written = s.num_tokens * cfg.kv_lora_rank * (b.lat - b.e)
    return Cost(nbytes + written + cfg.kv_lora_rank * b.e, f, b.precision())


def _query_contexts(s: StepShape) -> tuple[float, float]:
    """(tokens a decode query sees, tokens a prefill query sees on average)."""
    return s.mean_context, s.mean_context / 2


def _mla_indexer(cfg, s, b):
    t, h, qr = s.num_tokens, cfg.hidden_size, cfg.q_lora_rank
    ih, nih, pool = cfg.index_head_dim, cfg.index_n_heads, cfg.index_kpool
    projections = (h * ih + qr * nih * ih + h * nih) * b.w  # wk, wq_b, weights_proj
    weights = projections + (h * ih + 2 * ih + pool * ih) * b.e  # pool gate, k_norm, ape
    keys_written = t * ih * (b.key + b.e)  # key (as stored) and pool gate score
    c_dec, c_pre = _query_contexts(s)
    # Decodes read their own pool keys; a prompt's queries share one read of its pool keys.
    pool_reads = (s.num_decodes * c_dec + s.num_prefills * s.max_context) / pool * ih * b.key
    scored = (s.num_decodes * c_dec + s.prefill_tokens * c_pre) / pool  # pools scored, all queries
    flops = 2.0 * t * (2 * h * ih + qr * nih * ih + h * nih) + scored * nih * (2 * ih + 2)
    return Cost(weights + keys_written + pool_reads + t * (h + qr) * b.e, flops, b.precision())


def _mla_attention(cfg, s, b):
    c, heads = cfg.kv_lora_rank, cfg.num_attention_heads
    cap = cfg.index_topk + cfg.index_kpool - 1  # DSA bound on positions per query
    c_dec, c_pre = _query_contexts(s)
    k_dec, k_pre = min(c_dec, cap), min(c_pre, cap)
    # Decodes gather their selected latents; a prompt reads each of its latents once.
    latents = (s.num_decodes * k_dec + s.num_prefills * min(s.max_context, s.mean_context)) * c * b.lat
    data = 2 * s.num_tokens * heads * c * b.e  # q_latent in, latent output out
    flops = 4.0 * heads * c * (s.num_decodes * k_dec + s.prefill_tokens * k_pre)
    return Cost(latents + data, flops, _dtype_precision(b.e))


def _mla_o_proj(cfg, s, b):
    t, heads, v, c, h = s.num_tokens, cfg.num_attention_heads, cfg.v_head_dim, cfg.kv_lora_rank, cfg.hidden_size
    weights = heads * v * c * b.e + heads * v * h * b.w  # W_uv (folded), o_proj
    data = t * (heads * c + h) * b.e
    return Cost(weights + data, 2.0 * t * (heads * v * c + heads * v * h), b.precision())


def _moe_router(cfg, s, b):
    t, h, n_exp = s.num_tokens, cfg.hidden_size, cfg.n_routed_experts
    data = n_exp * h * b.e + n_exp * FP32 + t * h * b.e + t * cfg.num_experts_per_tok * 2 * FP32
    return Cost(data, 2.0 * t * h * n_exp, "fp32")


def experts_touched(cfg: TextModelConfig, tokens: int) -> float:
    """Expected distinct routed experts for `tokens` tokens, routing uniform at random."""
    n_exp, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return n_exp * (1.0 - (1.0 - k / n_exp) ** tokens)


def _moe_experts(cfg, s, b):
    t, h, inter, k = s.num_tokens, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    weights = experts_touched(cfg, t) * 3 * h * inter * b.w
    data = 2 * t * h * b.e + t * k * FP32
    return Cost(weights + data, 2.0 * t * k * 3 * h * inter, b.precision())


def _dense_mlp(t: int, h: int, inter: int, b: Storage) -> tuple[float, float]:
    return 3 * h * inter * b.w + 2 * t * h * b.e, 2.0 * t * 3 * h * inter


def _moe_shared(cfg, s, b):
    nbytes, f = _dense_mlp(s.num_tokens, cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, b)
    return Cost(nbytes, f, b.precision())


def _moe_experts_and_shared(cfg, s, b):
    """The routed and the shared experts in one native call (CPU, bf16, packed panels)."""
    return _moe_experts(cfg, s, b) + _moe_shared(cfg, s, b)


def _mlp_dense(cfg, s, b):
    nbytes, f = _dense_mlp(s.num_tokens, cfg.hidden_size, cfg.intermediate_size, b)
    return Cost(nbytes, f, b.precision())


def _final_norm(cfg, s, b):
    # Rows with logits: about one per request (a prompt chunk that does not finish has none).
    rows = s.num_requests
    return Cost(rows * cfg.hidden_size * (cfg.hc_mult + 1) * b.e, 4.0 * rows * cfg.hidden_size * cfg.hc_mult, _dtype_precision(b.e))


def _lm_head(cfg, s, b):
    rows, h, v = s.num_requests, cfg.hidden_size, cfg.vocab_size
    return Cost(v * h * b.e + rows * h * b.e + rows * v * FP32, 2.0 * rows * h * v, _dtype_precision(b.e))


OP_COSTS: dict[str, Callable[[TextModelConfig, StepShape, Storage], Cost]] = {
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
    "moe.experts_and_shared": _moe_experts_and_shared,
    "mlp.dense": _mlp_dense,
    "final_norm": _final_norm,
    "lm_head": _lm_head,
}


def op_cost(op: str, cfg: TextModelConfig, shape: StepShape, storage: float | Storage) -> Cost | None:
    """Cost of one call of op type `op` (e.g. "kda.recurrent"); None for ops not modelled.
    `storage`: a layer's Storage, or the model dtype's element size (nothing quantized)."""
    fn = OP_COSTS.get(op)
    return None if fn is None else fn(cfg, shape, _storage(storage))


def _storage(storage: float | Storage) -> Storage:
    return storage if isinstance(storage, Storage) else Storage.dense(storage)


def layer_ops(cfg: TextModelConfig, index: int) -> list[str]:
    """The op types layer `index` runs, each hc op twice (attention and FFN halves)."""
    attn = ["kda.qkv_proj", "kda.conv", "kda.gates", "kda.recurrent", "kda.out"]
    if cfg.is_mla_layer(index):
        attn = ["mla.q_proj", "mla.kv_proj"] + (["mla.indexer"] if cfg.is_full_indexer_layer(index) else [])
        attn += ["mla.attention", "mla.o_proj"]
    ffn = ["moe.router", "moe.experts", "moe.shared"] if cfg.mlp_layer_types[index] == "sparse" else ["mlp.dense"]
    return ["hc.collapse", "hc.expand"] * 2 + attn + ffn


def forward_cost(
    cfg: TextModelConfig, shape: StepShape, elem_bytes: float, layer_storage: Callable[[int], Storage] | None = None
) -> Cost:
    """Minimum cost of a whole forward pass (embedding to logits); `layer_storage(i)` says
    how layer i is stored (default: all in the model dtype, fp32 KDA states)."""
    dense = Storage.dense(elem_bytes)
    total = Cost(0.0, 0.0, _dtype_precision(elem_bytes))
    for op in ("embed", "final_norm", "lm_head"):
        total = total + OP_COSTS[op](cfg, shape, dense)
    for i in range(cfg.num_hidden_layers):
        storage = layer_storage(i) if layer_storage else dense
        for op in layer_ops(cfg, i):
            total = total + OP_COSTS[op](cfg, shape, storage)
    return total


def layer_storage(
    cfg: TextModelConfig, dtype: torch.dtype, int8_layers: set[int], cache_plan: CachePlan, replay: int = 0
) -> Callable[[int], Storage]:
    """How each layer is stored: W8A8 weights in `int8_layers`, caches as `cache_plan` says
    (int8/fp8 entries with their per-token scale), KDA decode with a ReplaySSM ring of
    `replay` steps (0: write-back)."""
    e = itemsize(dtype)

    def entry(component: str, layer: int, width: int) -> float:
        stored = cache_plan.for_layer(layer).dtype(component, dtype)
        return itemsize(stored) + (FP32 / width if stored in QMAX else 0.0)

    def of(i: int) -> Storage:
        state = itemsize(cache_plan.for_layer(i).dtype("kda_state", dtype))
        conv = itemsize(cache_plan.for_layer(i).dtype("kda_conv", dtype))
        return Storage(e, 1.0 if i in int8_layers else e, state, entry("latent", i, cfg.kv_lora_rank),
                       entry("index_keys", i, cfg.index_head_dim), conv, replay)

    return of


def model_storage(model, dtype: torch.dtype, cache_plan: CachePlan | None = None, replay: int = 0) -> Callable[[int], Storage]:
    """`layer_storage` of a loaded model: its int8 layers are those with W8A8 modules."""
    from oxserve.quantization.w8a8 import W8A8Experts, W8A8Linear

    int8 = {i for i, layer in enumerate(model.layers) if any(isinstance(m, (W8A8Linear, W8A8Experts)) for m in layer.modules())}
    return layer_storage(model.config, dtype, int8, cache_plan or CachePlan(), replay)


def decode_step_shape(batch: int, context: int = 1) -> StepShape:
    return StepShape(num_tokens=batch, num_requests=batch, num_decodes=batch, mean_context=context, max_context=context)
