"""Pre-quantized checkpoints: the `quantization_config` of config.json.

oxserve loads the compressed-tensors format (what llm-compressor writes and vLLM serves) for
one scheme, W8A8 int8: weights int8, symmetric, one scale per output channel; inputs int8,
symmetric, dynamic per token. Anything else is refused with the scheme named, never loaded
as something it is not. Which modules are quantized is read from the tensors themselves
(a `<module>.weight_scale` next to an int8 weight), which the config's `targets`/`ignore`
lists determined when the checkpoint was written.
"""

from __future__ import annotations

from typing import Any

from oxserve.model.linear import CheckpointError

SUPPORTED = "compressed-tensors int8 W8A8 (int-quantized: channel-wise symmetric weights, dynamic per-token symmetric inputs)"
WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
INPUTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


def read_scheme(raw_config: dict[str, Any]) -> bool:
    """True when config.json declares a supported pre-quantized checkpoint, False when it
    declares none; a CheckpointError naming the scheme otherwise."""
    qc = raw_config.get("quantization_config")
    if qc is None:
        return False
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise CheckpointError(f"quantization_config.quant_method {method!r} is not supported; oxserve loads {SUPPORTED}")
    fmt = qc.get("format")
    if fmt != "int-quantized":
        raise CheckpointError(f"compressed-tensors format {fmt!r} is not supported; oxserve loads {SUPPORTED}")
    if qc.get("kv_cache_scheme"):
        raise CheckpointError(f"compressed-tensors kv_cache_scheme {qc['kv_cache_scheme']!r} is not supported")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise CheckpointError("compressed-tensors quantization_config has no config_groups")
    for name, group in groups.items():
        _check(f"{name}.weights", group.get("weights"), WEIGHTS)
        if group.get("input_activations") is None:
            raise CheckpointError(f"compressed-tensors group {name} is weight-only (no input_activations); oxserve loads {SUPPORTED}")
        _check(f"{name}.input_activations", group.get("input_activations"), INPUTS)
        if group.get("output_activations") is not None:
            raise CheckpointError(f"compressed-tensors group {name} quantizes output activations, which oxserve does not support")
    return True


def _check(where: str, args: dict[str, Any] | None, wanted: dict[str, Any]) -> None:
    if args is None:
        raise CheckpointError(f"compressed-tensors {where} is missing; oxserve loads {SUPPORTED}")
    for key, value in wanted.items():
        if args.get(key) != value:
            raise CheckpointError(
                f"compressed-tensors {where}.{key}={args.get(key)!r} is not supported (needs {value!r}); oxserve loads {SUPPORTED}"
            )
    if args.get("group_size") is not None or args.get("block_structure") is not None:
        raise CheckpointError(f"compressed-tensors {where} uses groups or blocks; oxserve loads {SUPPORTED}")
