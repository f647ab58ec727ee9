"""KDA (Kimi Delta Attention) layer: short causal conv on q/k/v, forget gate, delta rule, gated norm."""

from __future__ import annotations

import torch
from torch import nn

from oxserve.cache.layers import KDACache
from oxserve.cache.precision import LayerCachePrecision
from oxserve.cache.spec import KDACacheSpec, ReplayRingSpec, StateTensor
from oxserve.kernels import kda_io
from oxserve.kernels.kda import causal_conv, conv_windows
from oxserve.kernels.kda_decode import replay_exact
from oxserve.model.activations import activation
from oxserve.model.batch import ForwardBatch
from oxserve.model.config import TextModelConfig
from oxserve.model.linear import Linear, copy_loader, empty_param, loadable
from oxserve.parallel.tensor import SINGLE, TensorParallel
from oxserve.telemetry import span


class ForgetGate(nn.Module):
    """The low-rank projection of the per-channel forget gate and its parameters; the gate's
    math is `kda_io.forget_decay`."""

    def __init__(self, cfg: TextModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        heads = tp.local(cfg.linear_num_heads, "linear_num_heads")
        self.f_a_proj = Linear(cfg.hidden_size, cfg.linear_head_dim)
        self.f_b_proj = Linear(cfg.linear_head_dim, cfg.kda_dim, tp, "column")
        self.dt_bias = loadable(empty_param(heads * cfg.linear_head_dim, dtype=torch.float32), split=tp.split(0))
        self.A_log = loadable(empty_param(heads, dtype=torch.float32), split=tp.split(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> the gate's pre-activation f [T, H*Dk] (before dt_bias)."""
        return self.f_b_proj(self.f_a_proj(x))


class KDAttention(nn.Module):
    """Under tensor parallelism a rank holds whole heads (their projections, conv channels and
    states); its output is a partial sum (row-parallel o_proj) for the caller to reduce."""

    def __init__(self, cfg: TextModelConfig, name: str, tp: TensorParallel = SINGLE):
        super().__init__()
        self.name = name
        self.num_heads = tp.local(cfg.linear_num_heads, "linear_num_heads")
        self.head_dim = cfg.linear_head_dim
        self.dim = self.num_heads * self.head_dim
        self.conv_kernel = cfg.linear_conv_kernel_dim
        self.qkv_proj = Linear(cfg.hidden_size, (cfg.kda_dim,) * 3, tp, "column")  # [q; k; v], fused at load time
        conv_rows = copy_loader((self.dim,) * 3, reshape=lambda t: t.reshape(t.shape[0], -1))  # [C, 1, K] -> [C, K]
        self.conv_weight = loadable(empty_param(3 * self.dim, self.conv_kernel, dtype=torch.float32), conv_rows,
                                    tp.split(0, (cfg.kda_dim,) * 3))  # fmt: skip
        self.conv_act, self.conv_act_name = activation(cfg.hidden_act), cfg.hidden_act
        self.forget_gate = ForgetGate(cfg, tp)
        self.b_proj = Linear(cfg.hidden_size, cfg.linear_num_heads, tp, "column")
        self.g_a_proj = Linear(cfg.hidden_size, cfg.linear_head_dim)
        self.g_b_proj = Linear(cfg.linear_head_dim, cfg.kda_dim, tp, "column")
        self.o_norm_weight = loadable(empty_param(cfg.linear_head_dim))
        self.o_proj = Linear(cfg.kda_dim, cfg.hidden_size, tp, "row")
        self.norm_eps = cfg.rms_norm_eps
        self.lower_bound = cfg.linear_lower_bound
        self.conv_taps: torch.Tensor | None = None  # conv_weight tap-major, for decode (after_load)

    def after_load(self) -> None:
        self.conv_taps = kda_io.conv_taps(self.conv_weight.detach())

    def cache_spec(
        self, dtype: torch.dtype, precision: LayerCachePrecision = LayerCachePrecision(), replay: int = 0
    ) -> KDACacheSpec:
        """`replay`: the ReplaySSM ring length (0: decode writes the state back)."""
        h, d = self.num_heads, self.head_dim
        ring = ReplayRingSpec(replay, h, d, d, replay_exact(self.lower_bound, replay)) if replay else None
        return KDACacheSpec(
            conv=StateTensor((self.conv_kernel - 1, 3 * self.dim), precision.dtype("kda_conv", dtype)),
            recurrent=StateTensor((h, d, d), precision.dtype("kda_state", dtype)),
            ring=ring,
        )

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KDACache) -> torch.Tensor:
        tracer = batch.tracer
        with span(tracer, f"{self.name}.qkv_proj"):
            mixed = self.qkv_proj(x)
        with span(tracer, f"{self.name}.gates"):
            f, beta_logits = self.forget_gate(x), self.b_proj(x)
        gate_params = (self.forget_gate.dt_bias, self.forget_gate.A_log, self.lower_bound)
        if self.conv_taps is not None and kda_io.conv_inputs_fit(
                mixed, f, beta_logits, cache.conv, self.conv_act_name, self.head_dim):
            with span(tracer, f"{self.name}.conv"):  # the conv and the gates' pointwise math, in one call
                if batch.num_verifies:  # staged from the states before the call updates them in place
                    nd, nv = batch.num_decodes, batch.num_verifies
                    cache.stage_conv(batch.state_slots[nd : nd + nv], kda_io.conv_windows(
                        mixed, cache.conv, batch.state_slots, batch.has_initial_state, batch.query_runs, nd, nv,
                        batch.conv.windows.shape[1]))
                q, k, v, g, beta = kda_io.conv_inputs(mixed, cache.conv, batch.state_slots, batch.has_initial_state,
                                                      batch.query_runs, self.conv_taps, f, *gate_params, beta_logits,
                                                      self.head_dim)
        else:
            with span(tracer, f"{self.name}.conv"):
                states = self._stage_conv_windows(mixed, batch, cache)
                mixed, states = causal_conv(mixed, states, self.conv_weight, batch.conv, self.conv_act)
                cache.store_conv_states(batch.state_slots, states)
            with span(tracer, f"{self.name}.gates"):
                q, k, v, g, beta = kda_io.kda_gates(mixed, f, *gate_params, beta_logits, self.head_dim)
        with span(tracer, f"{self.name}.recurrent"):
            core = self._delta_rule(q, k, v, g, beta, batch, cache)
        with span(tracer, f"{self.name}.out"):
            gate = self.g_b_proj(self.g_a_proj(x))
            return self.o_proj(kda_io.gated_norm(core, gate, self.o_norm_weight, self.norm_eps).to(x.dtype))

    @staticmethod
    def _stage_conv_windows(mixed: torch.Tensor, batch: ForwardBatch, cache: KDACache) -> torch.Tensor:
        """The conv states the step starts from (zeros without context); with verifies, the
        conv state after each verified token is staged too, for when drafts are rejected."""
        states = _initial(cache.conv_states(batch.state_slots).to(mixed.dtype), batch.has_initial_state)
        if batch.num_verifies:
            nd, nv = batch.num_decodes, batch.num_verifies
            cache.stage_conv(batch.state_slots[nd : nd + nv], conv_windows(mixed, states, batch.conv))
        return states

    def _delta_rule(self, q, k, v, g, beta, batch: ForwardBatch, cache: KDACache) -> torch.Tensor:
        """Decodes take one recurrent step each, on the cached states in place; verifies a
        run of such steps (ReplaySSM: rejected ones are undone by the ring count); prefill
        chunks run from their full states (`KDACache.prefill`)."""
        nd, nv = batch.num_decodes, batch.num_verifies
        parts = []
        if nd:
            parts.append(cache.decode(batch.state_slots[:nd], batch.rings, q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd]))
        t = nd
        if nv:
            lens = batch.query_lens[nd : nd + nv]
            t = nd + sum(lens)
            parts.append(cache.verify(batch.state_slots[nd : nd + nv], batch.rings, lens,
                                      q[nd:t], k[nd:t], v[nd:t], g[nd:t], beta[nd:t]))
        if nd + nv < batch.num_requests:
            slots = batch.state_slots[nd + nv :]
            cache.settle(slots, batch.rings)
            parts.append(cache.prefill(slots, batch.has_initial_state[nd + nv :], batch.query_lens[nd + nv :], batch.chunks,
                                       q[t:], k[t:], v[t:], g[t:], beta[t:]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def _initial(states: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    """Cached states where a request has context; zeros for a request that starts now."""
    return torch.where(has_initial_state.view(-1, *([1] * (states.dim() - 1))), states, 0.0)
