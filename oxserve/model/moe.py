"""Mixture of experts: sigmoid router with correction bias and group top-k, grouped expert GEMMs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from oxserve.kernels.moe import (
    panel_experts, panel_experts_fit, panel_routed, grouped_experts, grouped_gemm_supported, looped_experts, native_experts,
    native_experts_fit, native_route, native_route_fit, pack_panels,
)
from oxserve.model.common import DenseMLP
from oxserve.model.config import TextModelConfig
from oxserve.model.linear import copy_loader, empty_param, loadable
from oxserve.parallel.tensor import SINGLE, TensorParallel
from oxserve.telemetry import Tracer, span


class Router(nn.Module):
    def __init__(self, cfg: TextModelConfig):
        super().__init__()
        self.weight = loadable(empty_param(cfg.n_routed_experts, cfg.hidden_size))
        self.e_score_correction_bias = loadable(empty_param(cfg.n_routed_experts, dtype=torch.float32))
        self.top_k = cfg.num_experts_per_tok
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor

    def after_load(self) -> None:
        """The weight in fp32, which the logits are computed in (exact; no conversion a call)."""
        self.weight.data = self.weight.data.float()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] -> (weights [T, k] fp32, expert ids [T, k])."""
        if native_route_fit(x, self.weight, self.n_group):  # the same steps in one call
            return native_route(x, self.weight, self.e_score_correction_bias, self.n_group, self.topk_group, self.top_k,
                                self.norm_topk_prob, self.scaling)
        return self.route_torch(x)

    def route_torch(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        experts = self.choose(scores)
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """The top-k experts by score plus correction bias, among the top groups."""
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = choice.view(scores.shape[0], self.n_group, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~group_mask.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        return choice.topk(self.top_k, dim=-1, sorted=False).indices


class Experts(nn.Module):
    """Under tensor parallelism every rank holds every expert's share of its intermediate
    channels (tensor-parallel within each expert), or with `tp.expert_parallel` its own
    experts whole (expert-parallel); either way outputs are partial sums."""

    def __init__(self, cfg: TextModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        full = cfg.moe_intermediate_size
        if tp.expert_parallel:
            self.num_experts, inter = tp.local(cfg.n_routed_experts, "n_routed_experts"), full
            gate_up_split = down_split = tp.split(-3, experts=True)
        else:
            self.num_experts, inter = cfg.n_routed_experts, tp.local(full, "moe_intermediate_size")
            gate_up_split, down_split = tp.split(-2, (full, full)), tp.split(-1)
        self.sliced = tp.expert_parallel and tp.size > 1  # routed pairs go to other ranks' experts too
        self.first_expert = tp.rank * self.num_experts if self.sliced else 0  # this rank's experts start here
        # Stacked per expert; a checkpoint holds one tensor per expert (and part) or the whole stack.
        self.gate_up_proj = loadable(empty_param(self.num_experts, 2 * inter, cfg.hidden_size), copy_loader((inter, inter)),
                                     gate_up_split)  # fmt: skip
        self.down_proj = loadable(empty_param(self.num_experts, cfg.hidden_size, inter), split=down_split)
        self.swiglu_limit = cfg.swiglu_limit
        self.hidden_size, self.intermediate_size = cfg.hidden_size, inter
        self.packed = False  # after_load: the stacks are in the panel kernel's panels (gate_up_panels, down_panels)

    @property
    def routes_natively(self) -> bool:
        """Whether forward runs in one native call (packed panels, every expert on this rank)."""
        return self.packed and not self.sliced

    def takes_shared(self, shared: DenseMLP) -> bool:
        """Whether forward can run `shared` (the layer's shared expert) inside its own call."""
        return self.routes_natively and shared.panels is not None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                shared: DenseMLP | None = None) -> torch.Tensor:
        """Sort (token, expert) pairs by expert, run the experts, add each pair back to its token.
        Expert-parallel: only the pairs routed to this rank's experts. `shared`: a shared
        expert that `takes_shared` accepted, run and added in the same call."""
        if self.routes_natively:
            return panel_routed(x, weights, experts, self.gate_up_panels, self.down_panels, self.swiglu_limit,
                                None if shared is None else shared.panels)
        if shared is not None:
            raise ValueError("a shared expert runs inside the routed experts' call only where they route natively")
        return self.route_sorted(x, weights, experts)

    def route_sorted(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The routing in torch around `run_sorted`."""
        top_k = experts.shape[1]
        flat, pair_weights = experts.flatten() - self.first_expert, weights.flatten()
        pairs = None
        if self.sliced:
            pairs = ((flat >= 0) & (flat < self.num_experts)).nonzero().squeeze(1)
            flat, pair_weights = flat[pairs], pair_weights[pairs]
        order = flat.argsort(stable=True)
        # pairs per expert (bincount's counts; its output size would depend on the values for a captured step)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
        offsets = counts.cumsum(0).to(torch.int32)
        token_of = (order if pairs is None else pairs[order]) // top_k
        rows, row_weight = x.index_select(0, token_of), pair_weights.index_select(0, order)[:, None]
        out = self.run_sorted(rows, row_weight, offsets)
        return torch.zeros_like(x).index_add_(0, token_of, out)

    def after_load(self) -> None:
        """On a CPU with AMX, AVX512-BF16 or AVX2, bf16 stacks move into the panel kernel's panels,
        which hold the same values; the dense stacks are freed."""
        weight = self.gate_up_proj
        if not panel_experts_fit(weight.device, weight.dtype, self.hidden_size, self.intermediate_size):
            return
        self.register_buffer("gate_up_panels", pack_panels(weight.detach()), persistent=False)
        self.register_buffer("down_panels", pack_panels(self.down_proj.detach()), persistent=False)
        for param in (self.gate_up_proj, self.down_proj):
            param.data = param.data.new_empty(0)
        self.packed = True

    def run_sorted(self, rows: torch.Tensor, row_weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """rows [P, H] sorted by expert, row_weight [P, 1], offsets [E] -> [P, H]. Quantized
        experts replace this (and the parameters), not the routing around it."""
        if self.packed:  # CPU with AMX, AVX512-BF16 or AVX2, bf16: any number of rows
            return panel_experts(rows, row_weight, offsets, self.gate_up_panels, self.down_panels, self.swiglu_limit)
        hidden, inter = self.hidden_size, self.intermediate_size
        if native_experts_fit(rows, self.num_experts):  # decode on CPU in bf16
            run = native_experts
        elif grouped_gemm_supported(rows.device, rows.dtype, hidden, inter):
            run = grouped_experts
        else:
            run = looped_experts
        return run(rows, row_weight, offsets, self.gate_up_proj, self.down_proj, self.swiglu_limit)


class MoE(nn.Module):
    """The router is replicated; routed and shared experts return partial sums under tensor
    parallelism (one reduce for both, by the caller)."""

    def __init__(self, cfg: TextModelConfig, name: str, tp: TensorParallel = SINGLE):
        super().__init__()
        self.name = name
        self.gate = Router(cfg)
        self.experts = Experts(cfg, tp)
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = DenseMLP(cfg.hidden_size, shared, cfg.swiglu_limit, cfg.hidden_act, tp) if shared else None

    def forward(self, x: torch.Tensor, tracer: Tracer | None = None) -> torch.Tensor:
        with span(tracer, f"{self.name}.router"):
            weights, experts = self.gate(x)
        shared = self.shared_experts
        together = shared is not None and self.experts.takes_shared(shared)
        # One span for one call: the profile costs "experts_and_shared" as both, not the routed experts alone.
        with span(tracer, f"{self.name}.experts_and_shared" if together else f"{self.name}.experts"):
            routed = self.experts(x, weights, experts, shared if together else None)
        if shared is None or together:
            return routed
        with span(tracer, f"{self.name}.shared"):
            return routed + shared(x)
