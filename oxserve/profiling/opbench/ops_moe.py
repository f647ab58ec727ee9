"""MoE ops: the sigmoid router with group top-k, and the routed experts (what the engine runs,
the grouped GEMMs, the per-expert loop)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from oxserve.kernels.moe import grouped_experts, looped_experts
from oxserve.model.moe import Experts, Router
from oxserve.profiling.opbench.checks import bind_params, close_for, precision_of, randn, token_counts
from oxserve.profiling.opbench.registry import Case, Op, register_op

FP32 = torch.float32


# ---- router ---------------------------------------------------------------------------------


def _router_inputs(cfg, tokens, dtype, device, gen):
    h, n_exp = cfg.hidden_size, cfg.n_routed_experts
    return {
        "x": randn(gen, tokens, h, dtype=dtype, device=device),
        "weight": randn(gen, n_exp, h, dtype=dtype, device=device, scale=h**-0.5),
        "bias": randn(gen, n_exp, dtype=FP32, device=device, scale=0.1),
    }


def reference_router(cfg, i):
    """(dense routing weights [T, E], selection scores [T, E]; -inf for experts of dropped groups)."""
    x, w, bias = i["x"].double(), i["weight"].double(), i["bias"].double()
    tokens, n_exp = x.shape[0], w.shape[0]
    dense = torch.zeros(tokens, n_exp, dtype=torch.float64, device=x.device)
    choices = torch.empty_like(dense)
    per_group = n_exp // cfg.n_group
    for t in range(tokens):
        scores = torch.sigmoid(w @ x[t])
        choice = scores + bias
        if cfg.n_group > 1:
            groups = choice.view(cfg.n_group, per_group)
            group_score = groups.sort(descending=True).values[:, :2].sum(-1)
            dropped = group_score.argsort(descending=True)[cfg.topk_group :]
            choice = groups.clone()
            choice[dropped] = float("-inf")
            choice = choice.flatten()
        chosen = choice.argsort(descending=True)[: cfg.num_experts_per_tok]
        weight = scores[chosen]
        if cfg.norm_topk_prob:
            weight = weight / weight.sum()
        dense[t, chosen] = weight * cfg.routed_scaling_factor
        choices[t] = choice
    return dense, choices


def check_router(cfg, out, ref, inputs, tolerance: float = 1e-4) -> str | None:
    weights, experts = out
    dense_ref, choices = (t.to(weights.device) for t in ref)
    k, n_exp = cfg.num_experts_per_tok, cfg.n_routed_experts
    if torch.isnan(weights).any() or (experts < 0).any() or (experts >= n_exp).any():
        return "outputs not written, or expert ids out of range"
    if (experts.sort(dim=1).values.diff(dim=1) == 0).any():
        return "an expert is chosen twice for one token"
    picked = torch.zeros_like(dense_ref, dtype=torch.bool).scatter_(1, experts, True)
    for t in torch.nonzero((picked != (dense_ref > 0)).any(1)).flatten().tolist():
        # A different selection is right only if it differs within a near-tie.
        row = choices[t]
        if row[~picked[t]].max() - row[picked[t]].min() > tolerance * row.abs().max():
            return f"token {t}: experts {sorted(experts[t].tolist())} are not the top {k}"
    same = (picked == (dense_ref > 0)).all(1)
    dense = torch.zeros_like(dense_ref).scatter_(1, experts, weights.double())
    err = (dense[same] - dense_ref[same]).abs().max().item() if same.any() else 0.0
    scale = dense_ref.abs().max().item() or 1.0
    if err / scale > tolerance:
        return f"routing weights: max error {err / scale:.3g} of the largest, allowed {tolerance:.3g}"
    return None


def router_candidate(cfg, i):
    with torch.device("meta"):
        router = Router(cfg)
    bind_params(router, weight=i["weight"], e_score_correction_bias=i["bias"])

    def run(out):
        weights, experts = router(i["x"])
        out[0].copy_(weights)
        out[1].copy_(experts)
    return run


def _router_cases(cfg, shapes, dtype, device):
    k = cfg.num_experts_per_tok

    def cost(i):
        t, h = i["x"].shape
        data = sum(v.numel() * v.element_size() for v in i.values()) + t * k * (4 + 8)
        return data, 2.0 * t * h * cfg.n_routed_experts

    return [
        Case(f"T={t}", lambda gen, t=t: _router_inputs(cfg, t, dtype, device, gen),
             lambda i, t=t: (torch.empty(t, k, device=device), torch.empty(t, k, dtype=torch.long, device=device)),
             cost, "fp32")
        for t in token_counts(shapes)
    ]


register_op(Op("moe.router", _router_cases, reference_router, check_router, {"torch": router_candidate}))


# ---- grouped experts -------------------------------------------------------------------------


def _experts_inputs(cfg, tokens, dtype, device, gen):
    h, inter, n_exp, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    experts = torch.rand(tokens, n_exp, generator=gen, device=device).argsort(dim=1)[:, :k]  # distinct per token
    weights = torch.rand(tokens, k, generator=gen, device=device) + 0.1
    return {
        "x": randn(gen, tokens, h, dtype=dtype, device=device),
        "weights": weights / weights.sum(-1, keepdim=True),
        "experts": experts,
        "gate_up_proj": randn(gen, n_exp, 2 * inter, h, dtype=dtype, device=device, scale=h**-0.5),
        "down_proj": randn(gen, n_exp, h, inter, dtype=dtype, device=device, scale=inter**-0.5),
    }


def reference_experts(cfg, i):
    x, limit, inter = i["x"].double(), cfg.swiglu_limit, cfg.moe_intermediate_size
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, e in zip(i["weights"][t].tolist(), i["experts"][t].tolist(), strict=True):
            gate_up = i["gate_up_proj"][e].double() @ x[t]
            gate, up = gate_up[:inter], gate_up[inter:]
            act = F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
            out[t] += weight * (i["down_proj"][e].double() @ act)
    return (out,)


def experts_candidate(cfg, i):
    """What the engine runs: the `Experts` module, whichever kernel it picks for the case."""
    with torch.device("meta"):
        experts = Experts(cfg)
    bind_params(experts, gate_up_proj=i["gate_up_proj"], down_proj=i["down_proj"])
    experts.after_load()  # as loaded: packed for the panel kernel where the CPU has AMX, AVX512-BF16 or AVX2

    def run(out):
        out[0].copy_(experts(i["x"], i["weights"], i["experts"]))
    return run


def sorted_candidate(run_sorted):
    """A candidate from a kernel over rows sorted by expert (the routing around it as the engine's)."""
    def bind(cfg, i):
        def run(out):
            top_k = i["experts"].shape[1]
            flat = i["experts"].flatten()
            order = flat.argsort(stable=True)
            offsets = torch.bincount(flat, minlength=cfg.n_routed_experts).cumsum(0).to(torch.int32)
            token_of = order // top_k
            rows = run_sorted(i["x"][token_of], i["weights"].flatten()[order, None], offsets,
                              i["gate_up_proj"], i["down_proj"], cfg.swiglu_limit)
            out[0].copy_(torch.zeros_like(i["x"]).index_add_(0, token_of, rows))
        return run
    return bind


def _experts_cases(cfg, shapes, dtype, device):
    def cost(i):
        x = i["x"]
        touched = int(i["experts"].unique().numel())
        per_expert = i["gate_up_proj"][0].numel() + i["down_proj"][0].numel()
        data = (touched * per_expert + 2 * x.numel()) * x.element_size() + i["weights"].numel() * 12
        return data, 2.0 * i["experts"].numel() * per_expert

    return [
        Case(f"T={t}", lambda gen, t=t: _experts_inputs(cfg, t, dtype, device, gen),
             lambda i: (torch.empty_like(i["x"]),), cost, precision_of(dtype))
        for t in token_counts(shapes)
    ]


# engine: bf16 on CPU, the panel kernel where the CPU has AMX, AVX512-BF16 or AVX2, else the native kernel at few rows
# per expert; otherwise grouped
register_op(Op("moe.experts", _experts_cases, reference_experts, close_for("x"),
               {"engine": experts_candidate, "grouped": sorted_candidate(grouped_experts),
                "looped": sorted_candidate(looped_experts)}, weights=("gate_up_proj", "down_proj")))
