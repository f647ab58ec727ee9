"""KDA ops: the delta rule (decode step, chunked prefill) and the short causal conv."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from oxserve.kernels.kda import causal_conv_chunk, causal_conv_step, kda_chunked, kda_recurrent_step
from oxserve.profiling.opbench.checks import TOLERANCE, close, close_for, randn
from oxserve.profiling.opbench.registry import Case, Op, register_op, returning

FP32 = torch.float32


def _delta_inputs(cfg, tokens: int, batch: int | None, device, gen) -> dict:
    """q, k (l2-normalised, q scaled), v, log-decay g in (lower_bound, 0), beta in (0, 1), state.
    `batch` given: one token for each of `batch` requests; else `tokens` tokens of one request."""
    h, d = cfg.linear_num_heads, cfg.linear_head_dim
    lead = (batch,) if batch is not None else (tokens,)
    state_shape = (batch, h, d, d) if batch is not None else (h, d, d)
    q = F.normalize(randn(gen, *lead, h, d, dtype=FP32, device=device), dim=-1) * d**-0.5
    k = F.normalize(randn(gen, *lead, h, d, dtype=FP32, device=device), dim=-1)
    bound = cfg.linear_lower_bound if cfg.linear_lower_bound is not None else -5.0
    g = bound * torch.sigmoid(randn(gen, *lead, h, d, dtype=FP32, device=device))
    return {
        "q": q, "k": k, "v": randn(gen, *lead, h, d, dtype=FP32, device=device), "g": g,
        "beta": torch.sigmoid(randn(gen, *lead, h, dtype=FP32, device=device)),
        "state": randn(gen, *state_shape, dtype=FP32, device=device, scale=0.1),
    }


def _delta_step_plain(q, k, v, g, beta, state):
    """One token per head, any leading dims, as matrix-vector products:
    S <- diag(e^g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q."""
    state = state * g.exp().unsqueeze(-1)
    predicted = (k.unsqueeze(-2) @ state).squeeze(-2)  # S^T k
    state = state + k.unsqueeze(-1) * (beta.unsqueeze(-1) * (v - predicted)).unsqueeze(-2)
    return (q.unsqueeze(-2) @ state).squeeze(-2), state


def reference_recurrent_step(cfg, i):
    return _delta_step_plain(*(i[n].double() for n in ("q", "k", "v", "g", "beta", "state")))


def reference_chunked(cfg, i):
    """Token by token over the whole sequence."""
    q, k, v, g, beta, state = (i[n].double() for n in ("q", "k", "v", "g", "beta", "state"))
    outs = []
    for t in range(q.shape[0]):
        o, state = _delta_step_plain(q[t], k[t], v[t], g[t], beta[t], state)
        outs.append(o)
    return torch.stack(outs), state


def _delta_cost(i) -> tuple[float, float]:
    h, dk, dv = i["q"].shape[-2], i["q"].shape[-1], i["v"].shape[-1]
    tokens = i["q"].numel() // (h * dk)
    states = i["state"].numel() // (h * dk * dv)
    data = sum(t.numel() for t in i.values()) * 4 + (tokens * h * dv + states * h * dk * dv) * 4
    return data, 7.0 * tokens * h * dk * dv


def _recurrent_cases(cfg, shapes, dtype, device):
    h, d = cfg.linear_num_heads, cfg.linear_head_dim
    return [
        Case(f"B={b}", lambda gen, b=b: _delta_inputs(cfg, 1, b, device, gen),
             lambda i, b=b: (torch.empty(b, h, d, device=device), torch.empty(b, h, d, d, device=device)),
             _delta_cost, "fp32")
        for b in shapes.batches
    ]


def _chunked_cases(cfg, shapes, dtype, device):
    h, d = cfg.linear_num_heads, cfg.linear_head_dim
    return [
        Case(f"L={n}", lambda gen, n=n: _delta_inputs(cfg, n, None, device, gen),
             lambda i, n=n: (torch.empty(n, h, d, device=device), torch.empty(h, d, d, device=device)),
             _delta_cost, "fp32")
        for n in shapes.contexts
    ]


register_op(Op("kda.recurrent_step", _recurrent_cases, reference_recurrent_step, close(TOLERANCE[FP32]),
               {"torch": returning(kda_recurrent_step)}))
# The chunked form reorders a long fp32 recurrence: allow more rounding than a single step.
register_op(Op("kda.chunked", _chunked_cases, reference_chunked, close(1e-3), {"torch": returning(kda_chunked)}))


# ---- causal conv ---------------------------------------------------------------------------


def _conv_inputs(cfg, lead: tuple[int, ...], state_lead: tuple[int, ...], dtype, device, gen) -> dict:
    channels, width = 3 * cfg.kda_dim, cfg.linear_conv_kernel_dim
    return {
        "x": randn(gen, *lead, channels, dtype=dtype, device=device),
        "conv_state": randn(gen, *state_lead, width - 1, channels, dtype=dtype, device=device),
        "weight": randn(gen, channels, width, dtype=FP32, device=device, scale=width**-0.5),
    }


def reference_conv_step(cfg, i):
    x, state, w = i["x"].double(), i["conv_state"].double(), i["weight"].double()
    window = torch.cat([state, x.unsqueeze(1)], dim=1)  # [B, K, C], oldest first
    out = sum(window[:, j] * w[:, j] for j in range(w.shape[1]))
    return F.silu(out), window[:, 1:]


def reference_conv_chunk(cfg, i):
    x, state, w = i["x"].double(), i["conv_state"].double(), i["weight"].double()
    padded = torch.cat([state, x])
    width = w.shape[1]
    out = torch.stack([(padded[t : t + width].T * w).sum(-1) for t in range(x.shape[0])])
    return F.silu(out), padded[-(width - 1) :]


def _conv_cost(i) -> tuple[float, float]:
    x, state = i["x"], i["conv_state"]
    data = (2 * x.numel() + 2 * state.numel()) * x.element_size() + i["weight"].numel() * 4
    return data, 2.0 * x.numel() * i["weight"].shape[1]


def _conv_step_cases(cfg, shapes, dtype, device):
    return [
        Case(f"B={b}", lambda gen, b=b: _conv_inputs(cfg, (b,), (b,), dtype, device, gen),
             lambda i: (torch.empty_like(i["x"]), torch.empty_like(i["conv_state"])), _conv_cost, "fp32")
        for b in shapes.batches
    ]


def _conv_chunk_cases(cfg, shapes, dtype, device):
    return [
        Case(f"L={n}", lambda gen, n=n: _conv_inputs(cfg, (n,), (), dtype, device, gen),
             lambda i: (torch.empty_like(i["x"]), torch.empty_like(i["conv_state"])), _conv_cost, "fp32")
        for n in shapes.contexts
    ]


register_op(Op("conv.step", _conv_step_cases, reference_conv_step, close_for("x"),
               {"torch": returning(causal_conv_step)}))
register_op(Op("conv.chunk", _conv_chunk_cases, reference_conv_chunk, close_for("x"),
               {"torch": returning(causal_conv_chunk)}))
