"""A quantization plan: per layer, whether its weights are W8A8 and how its caches are stored.

    # written by `oxserve quantize sensitivity` (or by hand)
    layers:
      0: {weights: w8a8, kda_state: bfloat16, kda_conv: bfloat16}
      3: {weights: none, latent: int8, index_keys: fp8}

Layers and keys a plan leaves out take the engine options (`--quantization`,
`--kv-cache-dtype`, `--kda-state-dtype`, `--kda-conv-dtype`). `--quantization-plan FILE`
loads one.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from oxserve.cache.precision import CachePlan, LayerCachePrecision

WEIGHT_CHOICES = ("w8a8", "none")
CACHE_KEYS = ("latent", "index_keys", "kda_state", "kda_conv")


@dataclass(frozen=True)
class QuantizationPlan:
    layers: dict[int, dict[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for layer, entry in self.layers.items():
            if not isinstance(layer, int) or layer < 0:
                raise ValueError(f"quantization plan: layer keys are layer indices, got {layer!r}")
            for key, value in entry.items():
                if key == "weights":
                    if value not in WEIGHT_CHOICES:
                        raise ValueError(f"quantization plan: layer {layer} weights={value!r}; choose one of {WEIGHT_CHOICES}")
                elif key not in CACHE_KEYS:
                    raise ValueError(f"quantization plan: layer {layer} has unknown key {key!r} (known: weights, {', '.join(CACHE_KEYS)})")
            LayerCachePrecision(**{k: v for k, v in entry.items() if k in CACHE_KEYS})  # validates the dtypes

    @classmethod
    def load(cls, path: str | Path) -> QuantizationPlan:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict) or not isinstance(raw.get("layers", {}), dict):
            raise ValueError(f"quantization plan {path}: expected a mapping with a 'layers' mapping")
        return cls({int(k): dict(v or {}) for k, v in raw.get("layers", {}).items()})

    def dump(self, path: str | Path, header: str = "") -> None:
        comment = "".join(f"# {line}\n" for line in header.splitlines())
        body = yaml.safe_dump({"layers": {k: self.layers[k] for k in sorted(self.layers)}}, sort_keys=False)
        Path(path).write_text(comment + body)

    def weights(self, layer: int, default: str) -> str:
        return self.layers.get(layer, {}).get("weights", default)

    def cache_plan(self, default: LayerCachePrecision) -> CachePlan:
        layers = {}
        for layer, entry in self.layers.items():
            overrides = {k: v for k, v in entry.items() if k in CACHE_KEYS}
            if overrides:
                layers[layer] = LayerCachePrecision(**{**asdict(default), **overrides})
        return CachePlan(default, layers)


def layer_of(module_name: str) -> int | None:
    """The decoder layer a module belongs to (None: outside the decoder layers)."""
    m = re.match(r"layers\.(\d+)\.", module_name)
    return int(m[1]) if m else None
