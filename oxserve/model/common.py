"""Small building blocks shared by the glm5_next layers."""

from __future__ import annotations

import torch
from torch import nn

from oxserve.kernels.moe import panel_experts, panel_experts_fit, clamped_glu, pack_panels
from oxserve.kernels.norm import rms_norm
from oxserve.kernels.onednn import PanelLinear, OneDNNLinear
from oxserve.model.activations import activation
from oxserve.model.linear import Linear, empty_param, loadable
from oxserve.parallel.tensor import SINGLE, TensorParallel


class RMSNorm(nn.Module):
    """Normalise in fp32, cast back, then scale (the reference's order of operations:
    `oxserve.kernels.norm.rms_norm`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = loadable(empty_param(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class DenseMLP(nn.Module):
    """act(clamp(gate)) * clamp(up), projected down: the dense layers and the shared experts.
    Under tensor parallelism a rank holds its share of the intermediate channels, and its
    output is a partial sum for the caller to reduce.

    On a CPU with AMX, AVX512-BF16 or AVX2, a bf16 SiLU MLP runs as the single expert of the panel
    experts kernel (`after_load` moves its weights into the kernel's panels): one call, with
    the same bf16 roundings, instead of two oneDNN products and the GLU's eager ops."""

    def __init__(self, hidden: int, intermediate: int, swiglu_limit: float, hidden_act: str,
                 tp: TensorParallel = SINGLE):  # fmt: skip
        super().__init__()
        self.hidden, self.intermediate = hidden, tp.local(intermediate, "intermediate size")
        self.gate_up_proj = Linear(hidden, (intermediate, intermediate), tp, "column")  # [gate; up], fused at load time
        self.down_proj = Linear(intermediate, hidden, tp, "row")
        self.swiglu_limit = swiglu_limit
        self.hidden_act, self.act = hidden_act, activation(hidden_act)
        self.panels: tuple[torch.Tensor, torch.Tensor] | None = None  # (gate_up, down) packed for panel_experts
        self._ones = torch.ones(0)
        self._counts = torch.arange(0, dtype=torch.int32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            rows = x.reshape(-1, self.hidden)
            out = panel_experts(rows, self._unit_weights(rows.shape[0]), self._one_expert(rows.shape[0]), *self.panels,
                                self.swiglu_limit)  # fmt: skip
            return out.view(x.shape)
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(clamped_glu(gate, up, self.swiglu_limit, self.act))

    def _one_expert(self, rows: int) -> torch.Tensor:
        """The panel kernel's expert offsets for one expert holding every row, [rows] int32: a
        view of kept counts, as `_unit_weights` (a fresh `torch.tensor` is an op every replay,
        and splits the step's run of native calls in two)."""
        if self._counts.numel() <= rows:
            self._counts = torch.arange(max(rows + 1, 2 * self._counts.numel()), dtype=torch.int32)
        return self._counts[rows : rows + 1]

    def _unit_weights(self, rows: int) -> torch.Tensor:
        """Ones for `rows` rows: a view of a kept tensor (a view costs a captured step nothing,
        a fresh `torch.ones` an op every replay)."""
        if self._ones.numel() < rows:
            self._ones = torch.ones(max(rows, 2 * self._ones.numel()))
        return self._ones[:rows]

    def after_load(self) -> None:
        plain = all(type(p) in (Linear, OneDNNLinear, PanelLinear) for p in (self.gate_up_proj, self.down_proj))
        gate_up = self.gate_up_proj.dense_weight() if plain else None
        if (not plain or self.hidden_act not in ("silu", "swish")
                or not panel_experts_fit(gate_up.device, gate_up.dtype, self.hidden, self.intermediate)):
            return
        self.panels = (pack_panels(gate_up.detach()[None]), pack_panels(self.down_proj.dense_weight().detach()[None]))
        self.gate_up_proj = self.down_proj = None  # the panels hold the weights now
