"""Engine configurations as flat `option -> value` mappings, the form experiments pass around.

Option names are the `EngineConfig` section fields (`dtype`, `max_num_seqs`, ...), the same
names the CLI spells `--dtype`, `--max-num-seqs`; they are unique across sections.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from oxserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}


def option_names() -> dict[str, str]:
    """option -> the EngineConfig section that holds it."""
    return {f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def engine_config(options: Mapping[str, Any]) -> EngineConfig:
    """An EngineConfig with `options` over the defaults. Unknown names and bad values raise
    ValueError naming them."""
    names = option_names()
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ValueError(f"unknown engine option(s): {', '.join(unknown)} (known: {', '.join(sorted(names))})")
    parts: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    for name, value in options.items():
        parts[names[name]][name] = value
    try:
        return EngineConfig(**{section: SECTIONS[section](**kw) for section, kw in parts.items()})
    except TypeError as e:
        raise ValueError(f"bad engine options {dict(options)}: {e}") from e


def flat_options(config: EngineConfig) -> dict[str, Any]:
    return {k: v for section in SECTIONS for k, v in dataclasses.asdict(getattr(config, section)).items()}


def changed_options(config: EngineConfig) -> dict[str, Any]:
    """The options that differ from the defaults."""
    defaults = flat_options(EngineConfig())
    return {k: v for k, v in flat_options(config).items() if defaults[k] != v}
