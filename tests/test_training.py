"""The pieces `oxserve build-default-model --train` is made of: its chunked KDA against
transformers' own, and its MTP layer against oxserve's once written under checkpoint names."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import Glm5NextConfig
from transformers.models.glm5_next import modeling_glm5_next as hf

from oxserve.cache.spec import CacheLayout
from oxserve.default_model import build_checkpoint
from oxserve.default_model.train import TrainingMTP, chunk_kda
from oxserve.model.batch import BatchRequest, make_forward_batch
from oxserve.model.loader import load_model
from tiny_models import TINY_TEXT_CONFIG


@pytest.mark.parametrize("length", [1, 16, 37, 100])
def test_chunk_kda_equals_transformers_chunked_kda(length):
    """Same outputs and final state as HF's chunk_kimi_delta_attention (the parity tests'
    reference), from a given state, over lengths that do and do not fill whole chunks."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    b, h, dk, dv = 2, 3, 16, 24
    q, k = (torch.randn(b, length, h, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, length, h, dv, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(b, length, h, dk, generator=gen))  # GLM's lower bound: -5 per step
    beta = torch.sigmoid(torch.randn(b, length, h, generator=gen))
    state = torch.randn(b, h, dk, dv, generator=gen) * 0.1
    kwargs = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_out, ref_state = hf.chunk_kimi_delta_attention(q, k, v, g, beta, **kwargs)
    out, final = chunk_kda(q, k, v, g, beta, **kwargs)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final, ref_state, rtol=1e-4, atol=1e-5)


def test_training_mtp_written_under_checkpoint_names_is_oxserves_mtp_layer(tmp_path):
    """TrainingMTP's weights, exported by `checkpoint_tensors` into a checkpoint, make oxserve's
    MTP layer compute what TrainingMTP computes: the export's names and expert split are right."""
    text = TINY_TEXT_CONFIG
    n = text["num_hidden_layers"]
    path = build_checkpoint(tmp_path / "ckpt", text, seed=3, dtype=torch.float32, tokenizer=False, mtp=True)
    cfg = Glm5NextConfig(text_config={**text, "num_hidden_layers": n + 1,
                                      "layer_types": [*text["layer_types"], "indexed_attention"],
                                      "indexer_types": [*text["indexer_types"], "full"],
                                      "mlp_layer_types": [*text["mlp_layer_types"], "sparse"]}).text_config  # fmt: skip
    torch.manual_seed(random.randrange(2**31))
    mtp = TrainingMTP(cfg, n).eval()
    with torch.no_grad():  # fresh values everywhere (HF's modules start uninitialised), norms near 1
        for name, t in mtp.state_dict().items():
            t.copy_(torch.randn_like(t) * (0.3 if t.dim() == 1 or name.endswith("gate.weight") else 0.05)
                    + (1.0 if "norm" in name else 0.0))  # fmt: skip
    tensors = load_file(path / "model.safetensors")
    exported = mtp.checkpoint_tensors(f"model.language_model.layers.{n}.")
    assert set(exported) == {name for name in tensors if name.startswith(f"model.language_model.layers.{n}.")}
    save_file({**tensors, **{k: v.contiguous() for k, v in exported.items()}}, path / "model.safetensors")

    tokens = torch.randint(16, text["vocab_size"], (24,))
    hidden = torch.randn(24, text["hidden_size"])
    embed = tensors["model.language_model.embed_tokens.weight"]
    with torch.no_grad():
        expected = mtp(F.embedding(tokens, embed)[None], hidden[None])[0]
    model = load_model(path, dtype=torch.float32, with_mtp=True).model
    layout = CacheLayout(num_blocks=4, block_size=16, num_slots=1)
    cache = model.mtp.cache_spec(torch.float32).allocate(layout, "cpu")
    batch = make_forward_batch([BatchRequest(0, 24, [0, 1], 0, True)], model.config, layout.block_size, layout.num_blocks, "cpu")
    batch.logits_indices = torch.arange(24)
    with torch.inference_mode():
        got = model.mtp(model.embed(tokens), hidden, batch, cache)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
