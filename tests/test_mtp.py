"""The MTP layer against a reference written from its definition.

transformers does not run the MTP layer, so the reference is composed here: the glue
(enorm, hnorm, embedding-first concat, eh_proj, pre-norm residuals, shared_head.norm, the
target's lm head, the zeroed embedding at position 0) in plain torch, around HF's own
`Glm5NextTextAttention` (MLA + DSA with its indexer) and `Glm5NextTextMoE` modules, all
filled from the checkpoint's tensors by name.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import Glm5NextConfig
from transformers.models.glm5_next import modeling_glm5_next as hf

from hf_reference import MARGIN_EPS, _indexer_hook, _router_hook, record_comparison
from oxserve.cache.spec import CacheLayout
from oxserve.default_model import build_checkpoint, make_text_config
from oxserve.model.batch import BatchRequest, make_forward_batch
from oxserve.model.loader import load_model

TEXT = make_text_config(
    vocab_size=512, hidden_size=48, num_hidden_layers=4, intermediate_size=64, n_routed_experts=6,
    num_experts_per_tok=2, moe_intermediate_size=24, num_attention_heads=3, num_key_value_heads=3,
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8, index_n_heads=8,
    index_head_dim=8, index_topk=8, index_kpool=2, linear_num_heads=2, linear_head_dim=8,
)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _sub(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def reference_mtp(path, tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [T, V] of the MTP layer for next tokens `tokens` and target hidden states
    `hidden`, and [T] bool: the positions where the router's or the indexer's choice is a near
    tie (either pick is right; one layer, so a tie moves its own position alone)."""
    weights = {k: v.float() for k, v in load_file(path / "model.safetensors").items()}
    n, eps = TEXT["num_hidden_layers"], TEXT["rms_norm_eps"]
    w = _sub(weights, f"model.language_model.layers.{n}.")
    # HF blocks for layer index n: the config must say it is an MLA layer with a full indexer.
    schedule = dict(layer_types=["linear_attention"] * n + ["indexed_attention"], indexer_types=["full"] * (n + 1),
                    mlp_layer_types=["sparse"] * (n + 1))  # fmt: skip
    cfg = Glm5NextConfig(text_config={**TEXT, "num_hidden_layers": n + 1, **schedule}).text_config
    attn = hf.Glm5NextTextAttention(cfg, layer_idx=n).eval()
    attn.load_state_dict(_sub(w, "self_attn."))
    moe = hf.Glm5NextTextMoE(cfg).eval()
    experts = {k: v for k, v in _sub(w, "mlp.").items() if not k.startswith("experts.")}
    e = range(cfg.n_routed_experts)
    experts["experts.gate_up_proj"] = torch.stack([torch.cat([w[f"mlp.experts.{i}.gate_proj.weight"], w[f"mlp.experts.{i}.up_proj.weight"]]) for i in e])
    experts["experts.down_proj"] = torch.stack([w[f"mlp.experts.{i}.down_proj.weight"] for i in e])
    moe.load_state_dict(experts)

    embeds = F.embedding(torch.tensor(tokens), weights["model.language_model.embed_tokens.weight"])
    embeds[0] = 0.0  # position 0: no token precedes it
    x = F.linear(torch.cat([_rms(embeds, w["enorm.weight"], eps), _rms(hidden, w["hnorm.weight"], eps)], -1), w["eh_proj.weight"])
    mask = torch.ones(1, len(tokens), dtype=torch.bool)
    choices, margins = {}, {}
    hooks = [moe.gate.register_forward_hook(_router_hook(("router", n), choices, margins)),
             attn.indexer.register_forward_hook(_indexer_hook(("indexer", n), choices, margins), with_kwargs=True)]
    try:
        with torch.no_grad():
            a, _, _ = attn(_rms(x, w["input_layernorm.weight"], eps)[None], attention_mask=mask)
            y = x + a[0]
            z = y + moe(_rms(y, w["post_attention_layernorm.weight"], eps)[None])[0]
    finally:
        for hook in hooks:
            hook.remove()
    tied = torch.stack(list(margins.values())).min(0).values < MARGIN_EPS
    return F.linear(_rms(z, w["shared_head.norm.weight"], eps), weights["lm_head.weight"]), tied


def oxserve_mtp(path, tokens: list[int], hidden: torch.Tensor, chunk: int) -> torch.Tensor:
    model = load_model(path, dtype=torch.float32, with_mtp=True).model
    cfg = model.config
    layout = CacheLayout(num_blocks=8, block_size=16, num_slots=1)
    cache = model.mtp.cache_spec(torch.float32).allocate(layout, "cpu")
    table = random.sample(range(layout.num_blocks), -(-len(tokens) // layout.block_size))
    outs = []
    for start in range(0, len(tokens), chunk):
        end = min(start + chunk, len(tokens))
        batch = make_forward_batch([BatchRequest(start, end - start, table, 0, True)], cfg, layout.block_size, layout.num_blocks, "cpu")
        batch.logits_indices = torch.arange(end - start)
        with torch.inference_mode():
            embeds = model.embed(torch.tensor(tokens[start:end]))
            outs.append(model.compute_logits(model.mtp(embeds, hidden[start:end], batch, cache)))
    return torch.cat(outs)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Fresh weights, every tensor perturbed off its init: unit gates and zero biases make
    exact ties in the indexer's and router's top-k, which two correct programs break apart
    differently. Eight indexer heads keep all-zero (relu) pool scores rare for the same reason."""
    seed = random.randrange(2**31)
    print(f"mtp checkpoint seed {seed}")
    path = build_checkpoint(tmp_path_factory.mktemp("mtp"), TEXT, seed=seed, dtype=torch.float32, tokenizer=False, mtp=True)
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        scale = 0.3 if name.endswith("mlp.gate.weight") else 0.05 if t.dim() > 1 else 0.3
        t.add_(torch.randn(t.shape, generator=gen) * scale)
    save_file(tensors, path / "model.safetensors")
    return path


@pytest.mark.parametrize("chunk", [1, 5, 40])
def test_mtp_layer_matches_the_reference(checkpoint, chunk):
    tokens = [random.randrange(16, TEXT["vocab_size"]) for _ in range(40)]
    hidden = torch.randn(40, TEXT["hidden_size"])
    ref, tied = reference_mtp(checkpoint, tokens, hidden)
    ours = oxserve_mtp(checkpoint, tokens, hidden, chunk)
    record_comparison(int((~tied).sum()), len(tokens))
    torch.testing.assert_close(ours[~tied], ref[~tied], rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_mtp_layer_is_not_read_unless_asked_for(checkpoint):
    plain = load_model(checkpoint, dtype=torch.float32)
    assert plain.model.mtp is None
    assert not any(name.startswith("mtp.") for name, _ in plain.model.named_parameters())
