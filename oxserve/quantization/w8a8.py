"""W8A8 modules: drop-in replacements for `Linear` and the routed `Experts`.

Each holds its weights as per-output-channel int8 plus fp32 scales and multiplies through
`kernels.int8` (activations quantized per token on every call). Weights arrive either in
the model's dtype and are quantized once loaded (`--quantization w8a8`), or already int8 with
their scales, from a compressed-tensors checkpoint (`prequantized=True`): then `weight` is
an int8 parameter and `weight_scale` (`<param>_scale` for the experts) its scale, each
filled part by part by the checkpoint loader like any other parameter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from oxserve.kernels.int8 import (
    MAX_PANEL_K,
    PanelStack,
    column_multiple,
    pack_panels,
    pad_columns,
    panels_available,
    quantize_weight,
    unpack_panels,
    w8a8_grouped,
    w8a8_panels,
    w8a8_panels_linear,
    w8a8_panels_mlp,
    w8a8_panels_routed,
)
from oxserve.kernels.moe import clamped_glu, looped_experts
from oxserve.model.common import DenseMLP
from oxserve.model.linear import (
    CheckpointError,
    Linear,
    Shard,
    WeightLoader,
    copy_loader,
    empty_param,
    loadable,
    swap_modules,
)
from oxserve.model.moe import Experts
from oxserve.quantization.plan import layer_of

# Kept in high precision when quantizing on load: the head (its error reaches every logit
# directly) and kv_b_proj, which MLA folds into other matrices and never multiplies as a Linear.
KEEP_ON_LOAD = ("lm_head", "kv_b_proj")


def _scale_param(rows: int | tuple[int, ...], parts: tuple[int, ...] | None, leading: tuple[int, ...] = ()) -> nn.Parameter:
    """The fp32 scales of a pre-quantized weight; checkpoints store them as [rows, 1]."""
    total = rows if isinstance(rows, int) else sum(rows)
    return loadable(empty_param(*leading, total, dtype=torch.float32), copy_loader(parts, reshape=lambda t: t.reshape(-1)))


def int8_loader(part_rows: tuple[int, ...] | None = None) -> WeightLoader:
    """Copies int8 tensors only: a float part of a weight whose other parts are int8 is an error."""
    copy = copy_loader(part_rows)

    def load(param: nn.Parameter, tensor: torch.Tensor, shard: Shard) -> int:
        if tensor.dtype != torch.int8:
            raise CheckpointError(f"is {tensor.dtype}, but the checkpoint quantizes this weight (int8, with a weight_scale); "
                                  "every part of a fused weight must be quantized alike")
        return copy(param, tensor, shard)

    return load


class PackedInt8:
    """int8 weights [E, N, K], scales [E, N] and, when the weights were smoothed, the factors
    [E, K] the activations are multiplied by first. Kept as the panel kernel's panels where the
    CPU has them (AVX2 or AVX512-VNNI), else as rows with K zero-padded for the int16 kernel."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, in_features: int, inv_smooth: torch.Tensor | None = None):
        self.scale = scale.float().contiguous()
        self.in_features = in_features
        self.inv_smooth = None if inv_smooth is None else inv_smooth.float().contiguous()
        self.panels: tuple[torch.Tensor, torch.Tensor] | None = None  # (panels, weight sums)
        self.stack: PanelStack | None = None  # the panels as the one-call entry points take them
        self.rows: torch.Tensor | None = None
        if panels_available() and in_features <= MAX_PANEL_K:
            self.panels = pack_panels(qweight[..., :in_features].contiguous())
            self.stack = PanelStack.of(*self.panels, self.scale, self.inv_smooth)
        else:
            self.rows = pad_columns(qweight, column_multiple())

    @classmethod
    def from_weight(cls, weight: torch.Tensor, smooth: torch.Tensor | None = None) -> PackedInt8:
        """weight [E, N, K]; smooth [E, K]: SmoothQuant factors multiplied into the weight."""
        if smooth is not None:
            weight = weight.float() * smooth[:, None, :]
        q, scale = quantize_weight(weight)
        return cls(q, scale, weight.shape[-1], None if smooth is None else (1.0 / smooth).float())

    @property
    def qweight(self) -> torch.Tensor:
        """The int8 weights, [E, N, K] (K padded where the int16 kernel keeps them)."""
        if self.panels is not None:
            return unpack_panels(self.panels[0], self.scale.shape[-1], self.in_features)
        return self.rows

    def matmul(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and rows.device.type == "cpu":
            return w8a8_panels(rows, offsets, *self.panels, self.scale, self.inv_smooth)
        return w8a8_grouped(rows, offsets, self.qweight, self.scale, self.inv_smooth)

    def dequantized(self) -> torch.Tensor:
        """The weight this computes with, [E, N, K] fp32 (smoothing undone)."""
        w = self.qweight[..., : self.in_features].float() * self.scale[..., None]
        return w if self.inv_smooth is None else w * self.inv_smooth[:, None, :]


class InputRange:
    """Per-input-channel max |x| of what a module multiplies, while it is calibrated."""

    def __init__(self, groups: int, channels: int):
        self.absmax = torch.zeros(groups, channels)

    def observe(self, group: int, x: torch.Tensor) -> None:
        if x.numel():
            self.absmax[group] = torch.maximum(self.absmax[group], x.detach().abs().float().reshape(-1, x.shape[-1]).amax(0))


class W8A8Linear(nn.Module):
    """A Linear in int8. Quantized on load, it may be `deferred`: it then computes in high
    precision and records its input ranges until `quantize()` (SmoothQuant calibration)."""

    def __init__(self, linear: Linear, prequantized: bool = False, deferred: bool = False):
        super().__init__()
        self.in_features, self.out_parts = linear.in_features, linear.out_parts
        self.out_features = sum(linear.out_parts)
        self.prequantized, self.deferred = prequantized, deferred and not prequantized
        if prequantized:
            self.weight = loadable(empty_param(self.out_features, self.in_features, dtype=torch.int8), int8_loader(self.out_parts))
            self.weight_scale = _scale_param(self.out_parts, self.out_parts)
        else:
            self.weight = linear.weight
        self.dtype = linear.weight.dtype  # what the rest of the model computes in
        self.packed: PackedInt8 | None = None
        self.inputs = InputRange(1, self.in_features) if self.deferred else None

    def after_load(self) -> None:
        if self.prequantized:
            self.packed = PackedInt8(self.weight.detach()[None], self.weight_scale.detach()[None], self.in_features)
            self.weight_scale.data = self.weight_scale.data.new_empty(0)
            self.weight.data = self.weight.data.new_empty(0)
        elif not self.deferred:
            self.quantize()

    def quantize(self, smooth: torch.Tensor | None = None) -> None:
        """smooth [1, K]: SmoothQuant factors (None: plain per-channel quantization)."""
        self.packed = PackedInt8.from_weight(self.weight.detach()[None], smooth)
        self.weight.data = self.weight.data.new_empty(0)  # the int8 copy is the weight now
        self.inputs = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            if self.inputs is None:
                raise RuntimeError("W8A8Linear used before its weights were loaded")
            self.inputs.observe(0, x)
            return F.linear(x, self.weight)
        rows = x.reshape(-1, self.in_features)
        if self.packed.panels is not None and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32):
            out = w8a8_panels_linear(rows, *self.packed.panels, self.packed.scale[0], self.packed.inv_smooth)
        else:
            out = self.packed.matmul(rows, torch.tensor([rows.shape[0]], dtype=torch.int32)).to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        if self.packed is None:
            return self.weight
        return self.packed.dequantized()[0].to(self.dtype)


class W8A8Experts(Experts):
    """The routed experts with int8 gate|up and down stacks; routing is the parent's. May be
    `deferred` like W8A8Linear, recording each expert's gate|up and down input ranges."""

    def __init__(self, experts: Experts, prequantized: bool = False, deferred: bool = False):
        nn.Module.__init__(self)  # not Experts.__init__: the parameters are built here, from `experts`
        self.num_experts, self.swiglu_limit = experts.num_experts, experts.swiglu_limit
        self.sliced, self.first_expert = experts.sliced, experts.first_expert  # the parent's routing reads them
        self.packed = False  # the parent's one-call panel routing is for bf16 panels, not these
        (e, two_inter, hidden), inter = experts.gate_up_proj.shape, experts.down_proj.shape[2]
        self.shape = (hidden, inter)
        self.dtype = experts.gate_up_proj.dtype
        self.prequantized, self.deferred = prequantized, deferred and not prequantized
        if prequantized:
            gate_up = empty_param(e, two_inter, hidden, dtype=torch.int8)
            self.gate_up_proj = loadable(gate_up, int8_loader((inter, inter)))
            self.gate_up_proj_scale = _scale_param(two_inter, (inter, inter), (e,))
            self.down_proj = loadable(empty_param(e, hidden, inter, dtype=torch.int8), int8_loader())
            self.down_proj_scale = _scale_param(hidden, None, (e,))
        else:
            self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        self.gate_up: PackedInt8 | None = None
        self.down: PackedInt8 | None = None
        self.inputs = (InputRange(e, hidden), InputRange(e, inter)) if self.deferred else None

    def after_load(self) -> None:
        if self.prequantized:
            hidden, inter = self.shape
            self.gate_up = PackedInt8(self.gate_up_proj.detach(), self.gate_up_proj_scale.detach(), hidden)
            self.down = PackedInt8(self.down_proj.detach(), self.down_proj_scale.detach(), inter)
            for param in (self.gate_up_proj, self.down_proj, self.gate_up_proj_scale, self.down_proj_scale):
                param.data = param.data.new_empty(0)
        elif not self.deferred:
            self.quantize()

    def quantize(self, smooth_gate_up: torch.Tensor | None = None, smooth_down: torch.Tensor | None = None) -> None:
        self.gate_up = PackedInt8.from_weight(self.gate_up_proj.detach(), smooth_gate_up)
        self.down = PackedInt8.from_weight(self.down_proj.detach(), smooth_down)
        for param in (self.gate_up_proj, self.down_proj):
            param.data = param.data.new_empty(0)
        self.inputs = None

    @property
    def routes_natively(self) -> bool:
        """Whether forward runs in one native call: panels, every expert on this rank."""
        return not self.sliced and self.gate_up is not None and self.gate_up.stack is not None and self.down.stack is not None

    def takes_shared(self, shared: DenseMLP) -> bool:
        return self.routes_natively and isinstance(shared, W8A8DenseMLP) and shared.stacks() is not None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                shared: DenseMLP | None = None) -> torch.Tensor:
        """On panels (CPU), routing, both products and the GLU in one native call, with the
        shared expert when `takes_shared` accepted one; else the parent's routing around
        `run_sorted`."""
        if self.routes_natively and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32):
            return w8a8_panels_routed(x, weights, experts, self.gate_up.stack, self.down.stack, self.swiglu_limit,
                                      None if shared is None else shared.stacks())
        routed = self.route_sorted(x, weights, experts)
        return routed if shared is None else routed + shared(x)

    def run_sorted(self, rows: torch.Tensor, row_weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None or self.down is None:
            if self.inputs is None:
                raise RuntimeError("W8A8Experts used before its weights were loaded")
            return self._observed_dense(rows, row_weight, offsets)
        gate, up = self.gate_up.matmul(rows, offsets).chunk(2, dim=-1)
        act = clamped_glu(gate, up, self.swiglu_limit) * row_weight
        return self.down.matmul(act, offsets).to(rows.dtype)

    def _observed_dense(self, rows: torch.Tensor, row_weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The high-precision experts, one at a time, recording what each one multiplies."""
        gate_up_inputs, down_inputs = self.inputs

        def observe(expert: int, expert_rows: torch.Tensor, act: torch.Tensor) -> None:
            gate_up_inputs.observe(expert, expert_rows)
            down_inputs.observe(expert, act)

        return looped_experts(rows, row_weight, offsets, self.gate_up_proj, self.down_proj, self.swiglu_limit, observe)

    def dense_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) as computed with, for references and sensitivity."""
        if self.gate_up is None or self.down is None:
            return self.gate_up_proj, self.down_proj
        return self.gate_up.dequantized().to(self.dtype), self.down.dequantized().to(self.dtype)


class W8A8DenseMLP(DenseMLP):
    """A dense MLP or shared expert whose projections are W8A8Linear: on panels, gate|up, the
    clamped GLU (in fp32, as the routed experts' call computes it) and down in one native call
    (`w8a8_panels_mlp`), or inside the routed experts' call for a shared expert; otherwise
    DenseMLP's two products around the eager GLU."""

    def __init__(self, mlp: DenseMLP):
        nn.Module.__init__(self)  # not DenseMLP.__init__: the projections are `mlp`'s
        self.hidden, self.intermediate = mlp.hidden, mlp.intermediate
        self.gate_up_proj, self.down_proj = mlp.gate_up_proj, mlp.down_proj
        self.swiglu_limit, self.hidden_act, self.act = mlp.swiglu_limit, mlp.hidden_act, mlp.act
        self.panels = None  # DenseMLP's bf16 panels: never, the projections are int8
        self._ones = mlp._ones

    def stacks(self) -> tuple[PanelStack, PanelStack] | None:
        """(gate_up, down) panel stacks, where both projections are quantized onto panels."""
        gate_up, down = self.gate_up_proj, self.down_proj
        if self.hidden_act not in ("silu", "swish") or not all(
                isinstance(p, W8A8Linear) and p.packed is not None and p.packed.stack is not None for p in (gate_up, down)):
            return None
        return gate_up.packed.stack, down.packed.stack

    def after_load(self) -> None:
        pass  # DenseMLP's bf16 panels are not for int8 projections

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stacks = self.stacks()
        if stacks is None or x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32):
            return super().forward(x)
        return w8a8_panels_mlp(x.reshape(-1, self.hidden), *stacks, self.swiglu_limit).view(x.shape)


def quantize_w8a8_on_load(
    model: nn.Module, keep: tuple[str, ...] = KEEP_ON_LOAD, deferred: bool = False,
    in_layer: Callable[[int | None], bool] = lambda layer: True,
) -> int:
    """Swap (before loading) every routed-expert stack and every Linear except those named in
    `keep` (last name part), in the decoder layers `in_layer` accepts (None: outside them),
    for W8A8 modules that quantize the loaded weights; `deferred`: only once
    `smooth.calibrate_and_quantize` has measured their inputs."""

    def experts(name: str, module: Experts) -> nn.Module:
        return W8A8Experts(module, deferred=deferred) if in_layer(layer_of(name)) else module

    def linear(name: str, module: Linear) -> nn.Module:
        if name.rpartition(".")[2] in keep or not in_layer(layer_of(name)):
            return module
        return W8A8Linear(module, deferred=deferred)

    swapped = swap_modules(model, Experts, experts) + swap_modules(model, Linear, linear)
    _mlps_in_one_call(model)
    return swapped


def _mlps_in_one_call(model: nn.Module) -> None:
    """Dense MLPs whose projections are both W8A8 become W8A8DenseMLP (not counted among the
    swapped modules: their projections are)."""

    def mlp(name: str, module: DenseMLP) -> nn.Module:
        both = all(isinstance(p, W8A8Linear) for p in (module.gate_up_proj, module.down_proj))
        return W8A8DenseMLP(module) if both and type(module) is DenseMLP else module

    swap_modules(model, DenseMLP, mlp)


def use_prequantized_w8a8(model: nn.Module, modules: set[str]) -> None:
    """Swap the named modules for W8A8 modules that take int8 weights and scales from the
    checkpoint; a quantized module oxserve can only run in high precision is an error."""
    for name in sorted(modules):
        parent_name, _, attr = name.rpartition(".")
        module = model.get_submodule(name)
        if isinstance(module, Linear):
            replacement: nn.Module = W8A8Linear(module, prequantized=True)
        elif isinstance(module, Experts):
            replacement = W8A8Experts(module, prequantized=True)
        else:
            raise CheckpointError(f"the checkpoint quantizes {name} ({type(module).__name__}), which oxserve runs in high precision")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, replacement)
    _mlps_in_one_call(model)

