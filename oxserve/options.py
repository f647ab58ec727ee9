"""Engine options: the one set that the CLI, the `LLM` constructor and experiments share.

An option is a field of one of `EngineConfig`'s sections (`dtype`, `max_num_seqs`, ...),
spelled `--dtype`, `--max-num-seqs` on the command line; names are unique across sections.
The sections are read off `EngineConfig` itself, so this module works unchanged against any
revision's config (experiments copy it into older trees along with their harness).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

from oxserve.config import EngineConfig


def sections() -> dict[str, type]:
    """section name -> its config dataclass, in EngineConfig's order."""
    hints = typing.get_type_hints(EngineConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(EngineConfig)}


def option_names() -> dict[str, str]:
    """option -> the EngineConfig section that holds it."""
    return {f.name: section for section, cls in sections().items() for f in dataclasses.fields(cls)}


def engine_config(options: Mapping[str, Any]) -> EngineConfig:
    """An EngineConfig with `options` over the defaults. Unknown names and bad values raise
    ValueError naming them."""
    names = option_names()
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ValueError(f"unknown engine option(s): {', '.join(unknown)} (known: {', '.join(sorted(names))})")
    parts: dict[str, dict[str, Any]] = {section: {} for section in sections()}
    for name, value in options.items():
        choices = _choices(names[name], name)
        if choices is not None and value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
        parts[names[name]][name] = value
    try:
        return EngineConfig(**{section: cls(**parts[section]) for section, cls in sections().items()})
    except TypeError as e:
        raise ValueError(f"bad engine options {dict(options)}: {e}") from e


def _choices(section: str, name: str) -> tuple | None:
    """The values a field lists in its `choices` metadata (what `--help` offers), if any."""
    field = next(f for f in dataclasses.fields(sections()[section]) if f.name == name)
    return field.metadata.get("choices")


def flat_options(config: EngineConfig) -> dict[str, Any]:
    return {k: v for section in sections() for k, v in dataclasses.asdict(getattr(config, section)).items()}


def changed_options(config: EngineConfig) -> dict[str, Any]:
    """The options that differ from the defaults."""
    defaults = flat_options(EngineConfig())
    return {k: v for k, v in flat_options(config).items() if defaults[k] != v}
