"""The embedded default model: a small GLM-5.3-Flash-shaped checkpoint, built offline on first use.

`ensure_default_model()` returns a directory holding a Hugging Face-format checkpoint
(config, seeded random weights, BPE tokenizer) that both oxserve and transformers load.
It is built once into the cache and published with a single rename:

    <cache>/.default-model-v2.building-XXXX/   <- build_checkpoint writes here
        | os.rename (atomic; fails if another builder published first)
        v
    <cache>/default-model-v2/                  <- only ever complete

so a crash leaves at most a stray staging directory, never a half-written model, and two
concurrent builders both end up returning the same complete directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .build import (
    CHAT_TEMPLATE,
    SMALL_TEXT_CONFIG,
    SPECIAL_TOKENS,
    STOP_TOKENS,
    TEXT_MARKUP_TOKENS,
    TOKEN_IDS,
    build_checkpoint,
    make_text_config,
)

__all__ = [
    "CHAT_TEMPLATE",
    "SMALL_TEXT_CONFIG",
    "SPECIAL_TOKENS",
    "STOP_TOKENS",
    "TEXT_MARKUP_TOKENS",
    "TOKEN_IDS",
    "build_checkpoint",
    "default_model_dir",
    "ensure_default_model",
    "make_text_config",
]

# Bump when the built files change, so stale caches are not reused.
MODEL_DIR_NAME = "default-model-v2"


def default_model_dir() -> Path:
    """`$OXSERVE_CACHE_DIR/default-model-v2`, else `~/.cache/oxserve/default-model-v2`."""
    root = os.environ.get("OXSERVE_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "oxserve") / MODEL_DIR_NAME


def _is_built(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "tokenizer.json").is_file()


def ensure_default_model(path: str | Path | None = None, *, force: bool = False, overrides: dict | None = None) -> Path:
    """Builds the default model at `path` (default: `default_model_dir()`) unless it is there.

    With `force`, an existing model is replaced by a fresh build; `overrides` change fields
    of its text config (a variant of its shape).
    """
    path = Path(path) if path is not None else default_model_dir()
    if _is_built(path) and not force:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.building-", dir=path.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; the published model is not
        build_checkpoint(staging, make_text_config(**(overrides or {})))
        if force:
            _remove(path)
        _publish(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def _publish(staging: Path, path: Path) -> None:
    try:
        os.rename(staging, path)  # replaces nothing but an empty directory
    except OSError:
        if not _is_built(path):
            raise FileExistsError(f"{path} exists but is not a complete model; remove it or use --force")
        # else another builder published first: keep theirs, ours is discarded


def _remove(path: Path) -> None:
    """Moves `path` aside first so no reader ever sees it half-deleted."""
    if not path.exists():
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
    os.rename(path, trash / path.name)
    shutil.rmtree(trash)
