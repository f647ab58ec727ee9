"""The embedded default model, and the builder of random-weight models of its family.

`default_model()` is the trained checkpoint shipped in `trained/` (see `train.py`): a small
GLM-5.3-Flash-shaped model, MTP layer included, trained on the Python standard library's
source, so its text looks like its corpus and speculative decoding, quantization and prefix
studies see a model that has learned something.

`ensure_random_model()` writes seeded random weights (any shape: tests and shape studies)
into the cache, published with a single rename:

    <cache>/.random-model-v2.building-XXXX/   <- build_checkpoint writes here
        | os.rename (atomic; fails if another builder published first)
        v
    <cache>/random-model-v2/                  <- only ever complete

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
    "default_model",
    "ensure_random_model",
    "make_text_config",
    "random_model_dir",
]

TRAINED_MODEL_DIR = Path(__file__).parent / "trained"

# Bump when the built files change, so stale caches are not reused.
MODEL_DIR_NAME = "random-model-v2"


def default_model() -> Path:
    """The trained default model's directory (shipped with oxserve, nothing to build)."""
    if not _is_built(TRAINED_MODEL_DIR):
        raise FileNotFoundError(f"the default model is missing from {TRAINED_MODEL_DIR}; "
                                "reinstall oxserve or run `oxserve build-default-model --train --out DIR`")
    return TRAINED_MODEL_DIR


def random_model_dir() -> Path:
    """`$OXSERVE_CACHE_DIR/random-model-v2`, else `~/.cache/oxserve/random-model-v2`."""
    root = os.environ.get("OXSERVE_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "oxserve") / MODEL_DIR_NAME


def _is_built(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "tokenizer.json").is_file()


def ensure_random_model(path: str | Path | None = None, *, force: bool = False, overrides: dict | None = None) -> Path:
    """Builds the random-weight model at `path` (default: `random_model_dir()`) unless it is
    there: the builder's small shape (`SMALL_TEXT_CONFIG`), seeded random weights.

    With `force`, an existing model is replaced by a fresh build; `overrides` change fields
    of its text config (a variant of its shape).
    """
    path = Path(path) if path is not None else random_model_dir()
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
