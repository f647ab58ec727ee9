"""Per-layer sensitivity to quantization, and the cheapest plan within a KL budget.

One component of one layer is quantized at a time, the rest left in high precision, and
each variant is scored teacher-forced against the unquantized model (`quality.agreement`):

    weights     the layer's projections and experts in W8A8 (as `--quantization w8a8`
                would make them, SmoothQuant calibration included)
    latent      an MLA layer's latent cache in int8 / fp8
    index_keys  a full-indexer layer's DSA keys in int8 / fp8
    kda_state   a KDA layer's recurrent state in bf16
    kda_conv    a KDA layer's conv state in bf16 (when the model is not bf16 already)

KL divergences of small independent perturbations add, so the plan takes components in
order of increasing measured KL while their sum stays within the budget; the combined plan
is then measured end to end on held-out sequences, and its most sensitive component dropped
until the measurement, too, is within the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from oxserve.cache.precision import CachePlan, LayerCachePrecision
from oxserve.model.forced import forced_logits
from oxserve.model.glm5_next import Glm5NextForCausalLM
from oxserve.quantization.plan import QuantizationPlan
from oxserve.quantization.quality import Agreement, agreement

PREFILL_CHUNK = 64
DECODED = 16  # the last positions of each sequence are decoded one by one: caches are read back


@dataclass(frozen=True)
class Choice:
    layer: int
    component: str  # weights | latent | index_keys | kda_state | kda_conv
    value: str  # w8a8 | int8 | fp8 | bfloat16
    bytes_saved: float  # per model (weights), per token (latent, index_keys) or per request (kda_*)
    result: Agreement


def score(model: Glm5NextForCausalLM, sequences: list[list[int]], reference: list[torch.Tensor],
          cache_plan: CachePlan | None = None) -> Agreement:
    logits = [forced_logits(model, s, PREFILL_CHUNK, len(s) - DECODED, cache_plan=cache_plan) for s in sequences]
    return agreement(reference, logits)


def reference_logits(model: Glm5NextForCausalLM, sequences: list[list[int]]) -> list[torch.Tensor]:
    return [forced_logits(model, s, PREFILL_CHUNK, len(s) - DECODED) for s in sequences]


def _layer_bytes(layer: torch.nn.Module) -> tuple[float, float]:
    """(bytes of the layer's weights that W8A8 quantizes, in high precision and in int8)."""
    from oxserve.quantization.w8a8 import W8A8Experts, W8A8Linear

    dense = int8 = 0.0
    for module in layer.modules():
        if isinstance(module, W8A8Linear):
            packed = [module.packed]
        elif isinstance(module, W8A8Experts):
            packed = [module.gate_up, module.down]
        else:
            continue
        for p in packed:
            elements = p.scale.numel() * p.in_features
            dense += elements * module.dtype.itemsize
            int8 += elements + p.scale.numel() * 4
    return dense, int8


def measure(
    dense: Glm5NextForCausalLM, quantized: Glm5NextForCausalLM, sequences: list[list[int]],
    progress: Callable[[str], None] = lambda line: None,
) -> list[Choice]:
    """Every component of every layer, one at a time. `quantized` is the same model with
    every layer's weights in W8A8 (its layers are borrowed one by one)."""
    reference = reference_logits(dense, sequences)
    dtype = next(p.dtype for p in dense.parameters() if p.is_floating_point())
    specs = dense.cache_specs(dtype)
    choices = []
    for i, layer in enumerate(dense.layers):
        dense.layers[i] = quantized.layers[i]
        try:
            result = score(dense, sequences, reference)
        finally:
            dense.layers[i] = layer
        high, low = _layer_bytes(quantized.layers[i])
        choices.append(Choice(i, "weights", "w8a8", high - low, result))
        progress(f"layer {i} weights w8a8: {result}")
        candidates = []
        if hasattr(specs[i], "latent"):
            candidates += [("latent", v) for v in ("int8", "fp8")]
            if specs[i].index_keys is not None:
                candidates += [("index_keys", v) for v in ("int8", "fp8")]
        else:
            candidates.append(("kda_state", "bfloat16"))
            if dtype != torch.bfloat16:
                candidates.append(("kda_conv", "bfloat16"))
        for component, value in candidates:
            precision = LayerCachePrecision(**{component: value})
            plan = CachePlan(LayerCachePrecision(), {i: precision})
            result = score(dense, sequences, reference, plan)
            choices.append(Choice(i, component, value, _cache_bytes_saved(dense, i, component, precision, dtype), result))
            progress(f"layer {i} {component} {value}: {result}")
    return choices


def _cache_bytes_saved(model: Glm5NextForCausalLM, layer: int, component: str, precision: LayerCachePrecision,
                       dtype: torch.dtype) -> float:
    before = model.layers[layer].self_attn.cache_spec(dtype)
    after = model.layers[layer].self_attn.cache_spec(dtype, precision)
    if component in ("kda_state", "kda_conv"):
        return float(sum(t.bytes for t in before.states) - sum(t.bytes for t in after.states))
    return sum(t.bytes_per_token for t in before.paged) - sum(t.bytes_per_token for t in after.paged)


def choose_plan(choices: list[Choice], kl_budget: float) -> list[Choice]:
    """The least sensitive choice per (layer, component), taken in order of increasing KL
    while the predicted total (their sum) stays within the budget; a budget of 0 takes none
    (a KL measured as 0 on calibration text is not a promise of none elsewhere)."""
    best: dict[tuple[int, str], Choice] = {}
    for c in choices:
        key = (c.layer, c.component)
        if key not in best or c.result.mean_kl < best[key].result.mean_kl:
            best[key] = c
    taken, total = [], 0.0
    for c in sorted(best.values(), key=lambda c: c.result.mean_kl):
        if kl_budget > 0 and total + c.result.mean_kl <= kl_budget:
            taken.append(c)
            total += c.result.mean_kl
    return taken


def as_plan(taken: list[Choice], num_layers: int) -> QuantizationPlan:
    layers: dict[int, dict[str, str]] = {i: {"weights": "none"} for i in range(num_layers)}
    for c in taken:
        layers[c.layer][c.component] = c.value
    return QuantizationPlan(layers)
