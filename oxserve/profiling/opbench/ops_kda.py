"""KDA ops: the delta rule (decode step, chunked prefill) and the short causal conv."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from oxserve.kernels import reference
from oxserve.kernels.kda import causal_conv, chunk_layout, chunk_plan, conv_layout, kda_chunked, kda_recurrent_step
from oxserve.model.activations import activation
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


def reference_recurrent_step(cfg, i):
    return reference.delta_rule_step(*(i[n].double() for n in ("q", "k", "v", "g", "beta", "state")))


def reference_chunked(cfg, i):
    return reference.delta_rule(*(i[n].double() for n in ("q", "k", "v", "g", "beta", "state")))


def chunked_candidate(cfg, i):
    """One request's chunk through the packed kernel, laid out as the engine lays it out."""
    size, exact = chunk_plan(cfg.linear_lower_bound)
    layout = chunk_layout([i["q"].shape[0]], size, exact, i["q"].device)

    def run(out):
        o, state = kda_chunked(i["q"], i["k"], i["v"], i["g"], i["beta"], i["state"][None], layout)
        out[0].copy_(o)
        out[1].copy_(state[0])
    return run


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
register_op(Op("kda.chunked", _chunked_cases, reference_chunked, close(1e-3), {"torch": chunked_candidate}))


# ---- causal conv ---------------------------------------------------------------------------
# One op per shape class: a decode batch (one token for each of B requests) and one request's
# prompt chunk. Both go through the same packed kernel, as in the engine.


def _conv_inputs(cfg, lengths: list[int], dtype, device, gen) -> dict:
    channels, width = 3 * cfg.kda_dim, cfg.linear_conv_kernel_dim
    return {
        "x": randn(gen, sum(lengths), channels, dtype=dtype, device=device),
        "conv_state": randn(gen, len(lengths), width - 1, channels, dtype=dtype, device=device),
        "weight": randn(gen, channels, width, dtype=FP32, device=device, scale=width**-0.5),
    }


def _lengths(i) -> list[int]:
    requests, tokens = i["conv_state"].shape[0], i["x"].shape[0]
    return [1] * requests if requests == tokens else [tokens]


def reference_conv(cfg, i):
    act = activation(cfg.hidden_act)
    outs, states, start = [], [], 0
    for r, n in enumerate(_lengths(i)):
        out, state = reference.causal_conv(i["x"][start : start + n].double(), i["conv_state"][r].double(), i["weight"].double(), act)
        outs.append(out)
        states.append(state)
        start += n
    return torch.cat(outs), torch.stack(states)


def conv_candidate(cfg, i):
    layout = conv_layout(_lengths(i), cfg.linear_conv_kernel_dim, i["x"].device)
    act = activation(cfg.hidden_act)

    def run(out):
        o, states = causal_conv(i["x"], i["conv_state"], i["weight"], layout, act)
        out[0].copy_(o)
        out[1].copy_(states)
    return run


def _conv_cost(i) -> tuple[float, float]:
    x, state = i["x"], i["conv_state"]
    data = (2 * x.numel() + 2 * state.numel()) * x.element_size() + i["weight"].numel() * 4
    return data, 2.0 * x.numel() * i["weight"].shape[1]


def _conv_cases(cfg, labels_and_lengths, dtype, device):
    return [
        Case(label, lambda gen, n=lengths: _conv_inputs(cfg, n, dtype, device, gen),
             lambda i: (torch.empty_like(i["x"]), torch.empty_like(i["conv_state"])), _conv_cost, "fp32")
        for label, lengths in labels_and_lengths
    ]


def _conv_step_cases(cfg, shapes, dtype, device):
    return _conv_cases(cfg, [(f"B={b}", [1] * b) for b in shapes.batches], dtype, device)


def _conv_chunk_cases(cfg, shapes, dtype, device):
    return _conv_cases(cfg, [(f"L={n}", [n]) for n in shapes.contexts], dtype, device)


register_op(Op("conv.step", _conv_step_cases, reference_conv, close_for("x"), {"torch": conv_candidate}))
register_op(Op("conv.chunk", _conv_chunk_cases, reference_conv, close_for("x"), {"torch": conv_candidate}))
