"""KDA ops: the delta rule (decode step: write-back and ReplaySSM; chunked prefill), the short causal conv,
and the pointwise work around a decode step (conv + gates in, gated norm out)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from oxserve.kernels import kda_io, reference
from oxserve.cache.layers import ReplayRing
from oxserve.cache.replay import ring_counts
from oxserve.cache.spec import CacheLayout, ReplayRingSpec
from oxserve.kernels.kda import causal_conv, chunk_layout, chunk_plan, conv_layout, kda_chunked, kda_recurrent_step
from oxserve.kernels.kda_decode import (
    replay_exact,
    replay_step,
    replay_step_torch,
    replay_verify,
    replay_verify_torch,
    writeback_run,
    writeback_step,
    writeback_step_torch,
)
from oxserve.model.activations import activation
from oxserve.model.batch import token_runs
from oxserve.profiling.opbench.checks import TOLERANCE, close, close_for, compare, randn
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


def native_recurrent_candidate(cfg, i):
    """The engine's write-back decode: the step in place on a state table (here the output
    buffer, loaded with the input states: the copy a table-less call also makes)."""
    slots = torch.arange(i["state"].shape[0], device=i["state"].device)

    def run(out):
        out[1].copy_(i["state"])
        out[0].copy_(writeback_step(out[1], slots, i["q"], i["k"], i["v"], i["g"], i["beta"]))
    return run


register_op(Op("kda.recurrent_step", _recurrent_cases, reference_recurrent_step, close(TOLERANCE[FP32]),
               {"torch": returning(kda_recurrent_step), "native": native_recurrent_candidate}))


# ---- the same on a bf16 state table (`--kda-state-dtype bfloat16`) ----------------------------
# The input states are values bf16 holds; the output is checked at fp32's tolerance, the new
# state (rounded to bf16 once, as the table stores it) at bf16's.


def _bf16_state_cases(cfg, shapes, dtype, device):
    return [dataclasses.replace(case, make_inputs=lambda gen, make=case.make_inputs: _rounded_state(make(gen)),
                                cost=_bf16_state_cost) for case in _recurrent_cases(cfg, shapes, dtype, device)]


def _rounded_state(i: dict) -> dict:
    i["state"] = i["state"].bfloat16().float()
    return i


def _bf16_state_cost(i) -> tuple[float, float]:
    data, flops = _delta_cost(i)
    return data - i["state"].numel() * 4, flops  # the state read and written in 2 bytes, not 4


def _output_and_bf16_state(cfg, out, ref, inputs) -> str | None:
    for n, (got, want, tolerance) in enumerate(zip(out, ref, (TOLERANCE[FP32], TOLERANCE[torch.bfloat16]), strict=True)):
        if problem := compare(got, want, tolerance):
            return f"output {n}: {problem}"
    return None


def bf16_table_candidate(step):
    """`step` on a bf16 state table holding the input states (its new states widened into the
    output buffer)."""
    def candidate(cfg, i):
        slots = torch.arange(i["state"].shape[0], device=i["state"].device)
        table = i["state"].bfloat16()

        def run(out):
            table.copy_(i["state"])
            out[0].copy_(step(table, slots, i["q"], i["k"], i["v"], i["g"], i["beta"]))
            out[1].copy_(table)
        return run
    return candidate


register_op(Op("kda.recurrent_step_bf16_state", _bf16_state_cases, reference_recurrent_step, _output_and_bf16_state,
               {"torch": bf16_table_candidate(writeback_step_torch), "native": bf16_table_candidate(writeback_step)}))


# ---- ReplaySSM decode step -------------------------------------------------------------------
# A decode step from a checkpoint with a half-full ring (the mean over a ring's life): the
# inputs carry the steps since the checkpoint as tokens (for the reference) and as the ring
# they left (for the candidate), built by replaying them when the inputs are made.

REPLAY_RING = 16


def _replay_inputs(cfg, batch: int, device, gen) -> dict:
    i = _delta_inputs(cfg, 1, batch, device, gen)
    steps = REPLAY_RING // 2
    prev = [_delta_inputs(cfg, 1, batch, device, gen) for _ in range(steps)]
    for name in ("k", "v", "g", "beta"):
        i[f"prev_{name}"] = torch.stack([p[name] for p in prev])
    h, d = cfg.linear_num_heads, cfg.linear_head_dim
    spec = ReplayRingSpec(REPLAY_RING, h, d, d, replay_exact(cfg.linear_lower_bound, REPLAY_RING))
    ring = spec.allocate(CacheLayout(1, 1, batch), device)
    table, slots = i["state"].clone(), torch.arange(batch, device=device)
    for n, p in enumerate(prev):
        replay_step_torch(table, ring, slots, [n] * batch, p["q"], p["k"], p["v"], p["g"], p["beta"])
    i.update(ring_keys=ring.keys, ring_decays=ring.decays, ring_deltas=ring.deltas)
    return i


def reference_replay_step(cfg, i):
    state = i["state"].double()
    for n in range(i["prev_k"].shape[0]):
        _, state = reference.delta_rule_step(i["q"].double(), *(i[f"prev_{x}"][n].double() for x in ("k", "v", "g", "beta")), state)
    return (reference.delta_rule_step(*(i[n].double() for n in ("q", "k", "v", "g", "beta")), state)[0],)


def replay_candidate(cfg, i, step=replay_step):
    batch, steps = i["q"].shape[0], i["prev_k"].shape[0]
    ring = ReplayRing(i["ring_keys"], i["ring_decays"], i["ring_deltas"], replay_exact(cfg.linear_lower_bound, REPLAY_RING))
    slots = torch.arange(batch, device=i["q"].device)
    counts = [steps] * batch
    count_tensor = torch.tensor(counts, device=i["q"].device)

    def run(out):
        out[0].copy_(step(i["state"], ring, slots, counts, count_tensor, i["q"], i["k"], i["v"], i["g"], i["beta"]))
    return run


def _replay_cost(i) -> tuple[float, float]:
    b, h, dk = i["q"].shape
    dv, steps = i["v"].shape[-1], i["prev_k"].shape[0]
    current = sum(i[n].numel() for n in ("q", "k", "v", "g", "beta")) + b * h * dv  # in, o out
    ring = b * h * (steps * (dk + dv) + 2 * dk + dv)  # live keys and deltas read, one entry written
    return (current + i["state"].numel() + ring) * 4, b * h * (4.0 * dk * dv + steps * 2 * (dk + dv))


def _replay_cases(cfg, shapes, dtype, device):
    h, d = cfg.linear_num_heads, cfg.linear_head_dim
    return [
        Case(f"B={b}", lambda gen, b=b: _replay_inputs(cfg, b, device, gen),
             lambda i, b=b: (torch.empty(b, h, d, device=device),), _replay_cost, "fp32")
        for b in shapes.batches
    ]


register_op(Op("kda.replay_step", _replay_cases, reference_replay_step, close(TOLERANCE[FP32]),
               {"native": replay_candidate, "torch": lambda cfg, i: replay_candidate(cfg, i, _replay_step_torch)}))


def _replay_step_torch(states, ring, slots, counts, count_tensor, q, k, v, g, beta):
    return replay_step_torch(states, ring, slots, counts, q, k, v, g, beta)


# ---- ReplaySSM verify: a token and its drafts, from the same half-full ring ----------------

VERIFY_TOKENS = 4  # the last token and 3 drafts


def _verify_inputs(cfg, batch: int, device, gen) -> dict:
    i = _replay_inputs(cfg, batch, device, gen)
    run = [_delta_inputs(cfg, 1, batch, device, gen) for _ in range(VERIFY_TOKENS)]
    for name in ("q", "k", "v", "g", "beta"):  # [B * V, ...], request after request
        i[name] = torch.stack([r[name] for r in run], dim=1).flatten(0, 1)
    return i


def reference_replay_verify(cfg, i):
    batch = i["state"].shape[0]
    state = i["state"].double()
    for n in range(i["prev_k"].shape[0]):  # q does not change the state
        _, state = reference.delta_rule_step(*(i[f"prev_{x}"][n].double() for x in ("k", "k", "v", "g", "beta")), state)
    per_request = {n: i[n].double().view(batch, VERIFY_TOKENS, *i[n].shape[1:]) for n in ("q", "k", "v", "g", "beta")}
    outs = []
    for t in range(VERIFY_TOKENS):
        out, state = reference.delta_rule_step(*(per_request[n][:, t] for n in ("q", "k", "v", "g", "beta")), state)
        outs.append(out)
    return (torch.stack(outs, dim=1).flatten(0, 1),)


def verify_candidate(cfg, i, verify=replay_verify):
    batch, steps = i["state"].shape[0], i["prev_k"].shape[0]
    ring = ReplayRing(i["ring_keys"], i["ring_decays"], i["ring_deltas"], replay_exact(cfg.linear_lower_bound, REPLAY_RING))
    slots = torch.arange(batch, device=i["q"].device)

    lens = [VERIFY_TOKENS] * batch
    counts = ring_counts([], [], [steps] * batch, lens, slots.device)

    def run(out):
        out[0].copy_(verify(i["state"], ring, slots, counts, lens, i["q"], i["k"], i["v"], i["g"], i["beta"]))
    return run


def _verify_torch(states, ring, slots, counts, lens, q, k, v, g, beta):
    return replay_verify_torch(states, ring, slots, counts.verifies, lens, q, k, v, g, beta)


def _verify_cost(i) -> tuple[float, float]:
    b, h, dk = i["state"].shape[:3]
    dv, steps, t = i["v"].shape[-1], i["prev_k"].shape[0], i["q"].shape[0]
    current = sum(i[n].numel() for n in ("q", "k", "v", "g", "beta")) + t * h * dv
    ring = b * h * (steps * (dk + dv) + VERIFY_TOKENS * (2 * dk + dv))  # read once, V entries written
    flops = t * h * (4.0 * dk * dv + (steps + VERIFY_TOKENS) * 2 * (dk + dv))
    return (current + i["state"].numel() + ring) * 4, flops


def _verify_cases(cfg, shapes, dtype, device):
    h, d = cfg.linear_num_heads, cfg.linear_head_dim
    return [
        Case(f"B={b}", lambda gen, b=b: _verify_inputs(cfg, b, device, gen),
             lambda i, b=b: (torch.empty(b * VERIFY_TOKENS, h, d, device=device),), _verify_cost, "fp32")
        for b in shapes.batches
    ]


register_op(Op("kda.replay_verify", _verify_cases, reference_replay_verify, close(TOLERANCE[FP32]),
               {"native": verify_candidate, "torch": lambda cfg, i: verify_candidate(cfg, i, _verify_torch)}))
# The chunked form reorders a long fp32 recurrence: allow more rounding than a single step.
def native_run_candidate(cfg, i):
    """The engine's CPU prefill: the tokens one at a time on the state in place (a table of one)."""
    tokens, slots, fresh = i["q"].shape[0], torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.bool)

    def run(out):
        out[1].copy_(i["state"])
        out[0].copy_(writeback_run(out[1][None], slots, fresh, [tokens], i["q"], i["k"], i["v"], i["g"], i["beta"]))
    return run


register_op(Op("kda.chunked", _chunked_cases, reference_chunked, close(1e-3),
               {"torch": chunked_candidate, "native": native_run_candidate}))


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


# ---- decode inputs (conv + gates) and the gated output norm ---------------------------------
# The pointwise work around a decode step's delta rule (`oxserve.kernels.kda_io`). The
# candidates write the conv states into their output table (a copy of the input table:
# both pay the copy), so every call starts from the same states.


def _decode_io_inputs(cfg, batch: int, dtype, device, gen) -> dict:
    h, d, width = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    channels = 3 * h * d
    return {
        "mixed": randn(gen, batch, channels, dtype=dtype, device=device),
        "conv_table": randn(gen, batch, width - 1, channels, dtype=dtype, device=device),
        "slots": torch.randperm(batch, generator=gen).to(device),
        "conv_weight": randn(gen, channels, width, dtype=FP32, device=device, scale=width**-0.5),
        "f": randn(gen, batch, h * d, dtype=dtype, device=device, scale=3.0),
        "dt_bias": randn(gen, h * d, dtype=FP32, device=device),
        "a_log": randn(gen, h, dtype=FP32, device=device, scale=0.5),
        "beta_logits": randn(gen, batch, h, dtype=dtype, device=device, scale=2.0),
    }


def reference_decode_inputs(cfg, i):
    """Per request, in float64: the conv window, silu, l2-normalised q (scaled) and k, the
    forget gate's log-decay and beta; the table with each request's window shifted."""
    d = cfg.linear_head_dim
    batch = i["mixed"].shape[0]
    table = i["conv_table"].double().clone()
    window = torch.cat([table[i["slots"]], i["mixed"].double()[:, None]], dim=1)  # [B, K, C]
    conv = (window * i["conv_weight"].double().t()).sum(1)
    conv = conv * torch.sigmoid(conv)
    table[i["slots"]] = window[:, 1:]
    q, k, v = (t.reshape(batch, -1, d) for t in conv.chunk(3, dim=-1))
    q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() * d**-0.5
    k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    x = (i["f"].double() + i["dt_bias"].double()).view(batch, -1, d)
    rate = i["a_log"].double().exp().view(1, -1, 1)
    lower = cfg.linear_lower_bound
    g = lower * torch.sigmoid(rate * x) if lower is not None else -rate * F.softplus(x, threshold=20.0)
    return q, k, v, g, torch.sigmoid(i["beta_logits"].double()), table


def decode_inputs_candidate(cfg, i, native: bool = True):
    act = activation(cfg.hidden_act)
    gate = (i["f"], i["dt_bias"], i["a_log"], cfg.linear_lower_bound, i["beta_logits"], cfg.linear_head_dim)

    def run(out):
        table = out[5]
        table.copy_(i["conv_table"])
        batch = i["mixed"].shape[0]
        has_context = torch.ones(batch, dtype=torch.bool)
        if native and kda_io.conv_inputs_fit(i["mixed"], i["f"], i["beta_logits"], table, cfg.hidden_act,
                                             cfg.linear_head_dim):
            taps = kda_io.conv_taps(i["conv_weight"])  # the layer makes it once, at load; here it is timed too
            result = kda_io.conv_inputs(i["mixed"], table, i["slots"], has_context, token_runs([1] * batch), taps, *gate)
        else:
            result = kda_io.conv_inputs_torch(i["mixed"], table, i["slots"], has_context, [1] * batch, i["conv_weight"],
                                              act, *gate)
        for buffer, value in zip(out[:5], result, strict=True):
            buffer.copy_(value)
    return run


def _decode_io_cost(i) -> tuple[float, float]:
    table = i["conv_table"]
    data = sum(t.numel() * t.element_size() for t in i.values()) + table.numel() * table.element_size()
    q_out = i["mixed"].numel() + i["f"].numel() + i["beta_logits"].numel()  # q, k, v and g, beta, fp32
    return data + q_out * 4, 2.0 * i["mixed"].numel() * (table.shape[1] + 1) + 10.0 * i["mixed"].numel()


def _decode_io_cases(cfg, shapes, dtype, device):
    h, d, width = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim

    def outputs(i, b):
        return (*(torch.empty(b, h, d, device=device) for _ in range(4)), torch.empty(b, h, device=device),
                torch.empty(b, width - 1, 3 * h * d, dtype=dtype, device=device))
    return [
        Case(f"B={b}", lambda gen, b=b: _decode_io_inputs(cfg, b, dtype, device, gen),
             lambda i, b=b: outputs(i, b), _decode_io_cost, "fp32")
        for b in shapes.batches
    ]


register_op(Op("kda.decode_inputs", _decode_io_cases, reference_decode_inputs, close_for("mixed"),
               {"native": decode_inputs_candidate, "torch": lambda cfg, i: decode_inputs_candidate(cfg, i, native=False)}))


def _gated_norm_inputs(cfg, tokens: int, dtype, device, gen) -> dict:
    h, d = cfg.linear_num_heads, cfg.linear_head_dim
    return {
        "core": randn(gen, tokens, h, d, dtype=FP32, device=device, scale=3.0),
        "gate": randn(gen, tokens, h * d, dtype=dtype, device=device, scale=2.0),
        "weight": (torch.rand(d, generator=gen) + 0.5).to(dtype=dtype, device=device),
    }


def reference_gated_norm(cfg, i):
    core = i["core"].double()
    normed = core / (core.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps).sqrt()
    return ((i["weight"].double() * normed * torch.sigmoid(i["gate"].double().view(core.shape))).flatten(1),)


def _gated_norm_cases(cfg, shapes, dtype, device):
    h, d = cfg.linear_num_heads, cfg.linear_head_dim
    return [
        Case(f"B={b}", lambda gen, b=b: _gated_norm_inputs(cfg, b, dtype, device, gen),
             lambda i, b=b: (torch.empty(b, h * d, dtype=dtype, device=device),),
             lambda i: (sum(t.numel() * t.element_size() for t in i.values()) + i["gate"].numel() * i["gate"].element_size(),
                        8.0 * i["core"].numel()), "fp32")
        for b in shapes.batches
    ]


def _gated_norm_candidate(fn):
    return lambda cfg, i: returning(lambda core, gate, weight: fn(core, gate, weight, cfg.rms_norm_eps))(cfg, i)


register_op(Op("kda.gated_norm", _gated_norm_cases, reference_gated_norm, close_for("gate"),
               {"native": _gated_norm_candidate(kda_io.gated_norm), "torch": _gated_norm_candidate(kda_io.gated_norm_torch)}))
