"""In what precision each layer's caches are stored.

    latent      MLA latent per token            auto (the model's dtype), bfloat16, float32, fp8, int8
    index_keys  DSA indexer keys (token, pool)  the same choices
    kda_state   KDA recurrent state             float32, bfloat16
    kda_conv    KDA conv state (last K-1 inputs) auto (the model's dtype), bfloat16, float32

fp8 (e4m3) and int8 entries carry one fp32 scale per token (per pool for pool keys); the
indexer's pool gate scores stay in the model's dtype. vLLM and SGLang
take one cache dtype for every layer (`--kv-cache-dtype` here too); a quantization plan may
choose per layer (`oxserve quantize sensitivity` writes one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oxserve.cache.layers import FP8

CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32, "fp8": FP8, "int8": torch.int8,
}
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CONV_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LayerCachePrecision:
    latent: str = "auto"
    index_keys: str = "auto"
    kda_state: str = "float32"
    kda_conv: str = "auto"

    def __post_init__(self) -> None:
        for name in ("latent", "index_keys"):
            if getattr(self, name) not in CACHE_DTYPES:
                raise ValueError(f"cache dtype {name}={getattr(self, name)!r}: choose one of {sorted(CACHE_DTYPES)}")
        if self.kda_state not in STATE_DTYPES:
            raise ValueError(f"kda_state={self.kda_state!r}: choose one of {sorted(STATE_DTYPES)}")
        if self.kda_conv not in CONV_DTYPES:
            raise ValueError(f"kda_conv={self.kda_conv!r}: choose one of {sorted(CONV_DTYPES)}")

    def dtype(self, component: str, model_dtype: torch.dtype) -> torch.dtype:
        if component == "kda_state":
            return STATE_DTYPES[self.kda_state]
        if component == "kda_conv":
            return CONV_DTYPES[self.kda_conv] or model_dtype
        return CACHE_DTYPES[getattr(self, component)] or model_dtype


@dataclass(frozen=True)
class CachePlan:
    default: LayerCachePrecision = LayerCachePrecision()
    layers: dict[int, LayerCachePrecision] = field(default_factory=dict)

    def for_layer(self, index: int) -> LayerCachePrecision:
        return self.layers.get(index, self.default)
