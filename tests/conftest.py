"""Shared fixtures: a tiny glm5_next checkpoint with a tokenizer, built once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import hf_reference as a plain module

from oxserve.default_model import build_checkpoint  # noqa: E402
from tiny_models import TINY_TEXT_CONFIG  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-model"), TINY_TEXT_CONFIG, seed=7, dtype=torch.float32)
