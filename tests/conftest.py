"""Shared fixtures: a tiny glm5_next checkpoint with a tokenizer, built once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import hf_reference as a plain module

from oxserve.default_model import build_checkpoint, make_text_config  # noqa: E402

TINY_TEXT_CONFIG = make_text_config(
    hidden_size=64, num_hidden_layers=4, intermediate_size=96, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=16,
    qk_nope_head_dim=16, v_head_dim=16, index_n_heads=8, index_head_dim=16, index_topk=16, index_kpool=4,
    linear_num_heads=2, linear_head_dim=16, vocab_size=8192,
)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-model"), TINY_TEXT_CONFIG, seed=7, dtype=torch.float32)
