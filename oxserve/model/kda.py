"""KDA (Kimi Delta Attention) layer: short causal conv on q/k/v, forget gate, delta rule, gated norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from oxserve.cache.tensors import KDALayerCache
from oxserve.kernels.kda import causal_conv_chunk, causal_conv_step, kda_chunked, kda_recurrent_step, l2norm
from oxserve.model.batch import ForwardBatch
from oxserve.model.common import Linear, empty_param
from oxserve.model.config import TextModelConfig
from oxserve.telemetry import span


class ForgetGate(nn.Module):
    def __init__(self, cfg: TextModelConfig):
        super().__init__()
        self.head_dim = cfg.linear_head_dim
        self.f_a_proj = Linear(cfg.hidden_size, cfg.linear_head_dim)
        self.f_b_proj = Linear(cfg.linear_head_dim, cfg.kda_dim)
        self.dt_bias = empty_param(cfg.kda_dim, dtype=torch.float32)
        self.A_log = empty_param(cfg.linear_num_heads, dtype=torch.float32)
        self.lower_bound = cfg.linear_lower_bound

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> per-channel log-decay g [T, H, Dk] (fp32, <= 0)."""
        g = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias).view(x.shape[0], -1, self.head_dim)
        rate = self.A_log.exp().view(1, -1, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * g)
        return -rate * F.softplus(g, threshold=20.0)


class KDAttention(nn.Module):
    def __init__(self, cfg: TextModelConfig, name: str):
        super().__init__()
        self.name = name
        self.num_heads = cfg.linear_num_heads
        self.head_dim = cfg.linear_head_dim
        self.dim = cfg.kda_dim
        self.qkv_proj = Linear(cfg.hidden_size, 3 * cfg.kda_dim)  # [q; k; v], fused at load time
        self.conv_weight = empty_param(3 * cfg.kda_dim, cfg.linear_conv_kernel_dim, dtype=torch.float32)
        self.forget_gate = ForgetGate(cfg)
        self.b_proj = Linear(cfg.hidden_size, cfg.linear_num_heads)
        self.g_a_proj = Linear(cfg.hidden_size, cfg.linear_head_dim)
        self.g_b_proj = Linear(cfg.linear_head_dim, cfg.kda_dim)
        self.o_norm_weight = empty_param(cfg.linear_head_dim)
        self.o_proj = Linear(cfg.kda_dim, cfg.hidden_size)
        self.norm_eps = cfg.rms_norm_eps

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KDALayerCache) -> torch.Tensor:
        tokens, tracer = x.shape[0], batch.tracer
        with span(tracer, f"{self.name}.qkv_proj"):
            mixed = self.qkv_proj(x)
        with span(tracer, f"{self.name}.conv"):
            mixed = self._conv(mixed, batch, cache)
        with span(tracer, f"{self.name}.gates"):
            q, k, v = (t.float().view(tokens, self.num_heads, self.head_dim) for t in mixed.split(self.dim, dim=-1))
            q = l2norm(q) * self.head_dim**-0.5
            k = l2norm(k)
            g = self.forget_gate(x)
            beta = torch.sigmoid(self.b_proj(x)).float()
        with span(tracer, f"{self.name}.recurrent"):
            core = self._delta_rule(q, k, v, g, beta, batch, cache)
        with span(tracer, f"{self.name}.out"):
            gate = self.g_b_proj(self.g_a_proj(x)).view(tokens, self.num_heads, self.head_dim)
            return self.o_proj(self._gated_norm(core, gate).to(x.dtype).view(tokens, self.dim))

    def _conv(self, mixed: torch.Tensor, batch: ForwardBatch, cache: KDALayerCache) -> torch.Tensor:
        out = torch.empty_like(mixed)
        nd = batch.num_decodes
        if nd:
            slots = batch.state_slots[:nd]
            out[:nd], cache.conv[slots] = causal_conv_step(mixed[:nd], cache.conv[slots], self.conv_weight)
        starts = batch.query_start
        slots = batch.state_slots.tolist()
        for r in range(nd, batch.num_requests):
            s, e = starts[r], starts[r + 1]
            state = cache.conv[slots[r]] if batch.context_lens[r] else torch.zeros_like(cache.conv[slots[r]])
            out[s:e], cache.conv[slots[r]] = causal_conv_chunk(mixed[s:e], state, self.conv_weight)
        return out

    def _delta_rule(self, q, k, v, g, beta, batch: ForwardBatch, cache: KDALayerCache) -> torch.Tensor:
        out = torch.empty_like(v)
        nd = batch.num_decodes
        if nd:
            slots = batch.state_slots[:nd]
            out[:nd], cache.recurrent[slots] = kda_recurrent_step(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], cache.recurrent[slots])
        starts = batch.query_start
        slots = batch.state_slots.tolist()
        for r in range(nd, batch.num_requests):
            s, e = starts[r], starts[r + 1]
            state = cache.recurrent[slots[r]]
            state = state if batch.context_lens[r] else torch.zeros_like(state)
            out[s:e], cache.recurrent[slots[r]] = kda_chunked(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], state)
        return out

    def _gated_norm(self, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        return self.o_norm_weight.float() * normed * torch.sigmoid(gate.float())
