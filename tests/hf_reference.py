"""The oracle: HF transformers 5.23.0 `glm5_next` on random tiny configurations.

Discrete choices (MoE router top-k, DSA indexer top-k) are discontinuous: where the
reference's k-th and (k+1)-th candidates are nearly tied, two correct implementations may
pick differently and the difference then flows on through the recurrent state. We measure
the reference's own margins at every position; comparison of a sequence stops at the first
position whose margin is below `MARGIN_EPS` (relative), and nowhere else is anything excused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
from transformers.models.glm5_next import modeling_glm5_next as hf

MARGIN_EPS = 1e-5
LOGIT_TOL = 1e-4  # times max |logit|
LOGPROB_TOL = 1e-4

VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, projection_intermediate_size=32)


def tiny_config(**overrides) -> dict:
    """A small text config in the shape of GLM-5.3-Flash: KDA x3 then MLA/DSA, mHC, MoE."""
    cfg = dict(
        vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
        kv_lora_rank=32, q_lora_rank=48, v_head_dim=16, qk_nope_head_dim=16, index_topk=32, index_head_dim=16,
        index_n_heads=8, linear_head_dim=16, linear_num_heads=4, hc_mult=4, index_kpool=4, pad_token_id=0,
        eos_token_id=1,
    )
    cfg.update(overrides)
    return cfg


# Configurations the parity tests cover (see the engine-core issue's list).
CONFIGS = {
    # k-pool 4, sparse selection well below the context, a shared indexer layer after a full one.
    "kpool4_shared": tiny_config(
        layer_types=["linear_attention"] * 3 + ["indexed_attention"] * 2 + ["linear_attention"] * 2 + ["indexed_attention"],
        indexer_types=["full"] * 4 + ["shared"] + ["full"] * 3,
        mlp_layer_types=["dense"] + ["sparse"] * 7,
    ),
    # k-pool 16, the default i % 4 == 3 layer rule, two dense layers, unbounded forget gate.
    "kpool16": tiny_config(
        index_kpool=16, index_topk=64, mlp_layer_types=["dense"] * 2 + ["sparse"] * 6, linear_lower_bound=None,
    ),
}


@dataclass
class Reference:
    model: Glm5NextForConditionalGeneration
    path: Path


def build_reference(name: str, directory: Path, seed: int) -> Reference:
    """A random HF model whose every parameter is non-trivial, saved as a checkpoint."""
    torch.manual_seed(seed)
    config = Glm5NextConfig(text_config=CONFIGS[name], vision_config=dict(VISION, out_hidden_size=64))
    model = Glm5NextForConditionalGeneration(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "visual" not in pname:
                # Inits such as zero ape / unit gates / zero bias would hide indexing bugs. Router
                # weights get a wider spread, as in trained models: tiny random routers crowd
                # their scores together and make near ties common.
                scale = 0.3 if pname.endswith("mlp.gate.weight") else 0.05 if p.dim() > 1 else 0.3
                p.add_(torch.randn_like(p) * scale)
    model.save_pretrained(directory)
    return Reference(model=model, path=directory)


@torch.no_grad()
def teacher_forced(ref: Reference, tokens: list[int]) -> tuple[torch.Tensor, int, int]:
    """HF logits [L, V] for `tokens`, the first position whose discrete choice is a near tie,
    and how many positions have one."""
    margins: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(_router_margin(margins)) for m in ref.model.modules() if isinstance(m, hf.Glm5NextTextTopkRouter)]
    hooks += [
        m.register_forward_hook(_indexer_margin(margins), with_kwargs=True)
        for m in ref.model.modules()
        if isinstance(m, hf.Glm5NextTextIndexer)
    ]
    try:
        logits = ref.model(input_ids=torch.tensor([tokens])).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    tight = torch.stack(margins).min(0).values < MARGIN_EPS if margins else torch.zeros(len(tokens), dtype=torch.bool)
    first = int(tight.nonzero()[0]) if tight.any() else len(tokens)
    num_tight = int(tight.sum())
    # Near ties are rare on these models; many of them means the margin rule excuses too much.
    assert num_tight <= 2 + 0.02 * len(tokens), f"{num_tight} near-tie positions in {len(tokens)}"
    return logits, first, num_tight


def _router_margin(out: list[torch.Tensor]):
    def hook(module, args, result):
        router_logits, _, _ = result
        scores = router_logits.sigmoid() + module.e_score_correction_bias
        top = scores.topk(module.top_k + 1, dim=-1).values
        gap = top[:, module.top_k - 1] - top[:, module.top_k]
        out.append(gap / top[:, 0].abs().clamp(min=1.0))

    return hook


def _indexer_margin(out: list[torch.Tensor]):
    """Recompute the reference indexer's pool scores (same module, same functions) for their margins."""

    def hook(module, args, kwargs, result):
        hs, q_resid, mask = kwargs["hidden_states"], kwargs["q_resid"], kwargs["attention_mask"]
        b, s = hs.shape[:2]
        q = module.wq_b(q_resid).view(b, s, -1, module.head_dim)
        k = module.k_norm(module.wk(hs))
        packed = torch.cat([k, F.linear(hs, module.index_kpool_compress_gate), mask.to(k.dtype)[..., None]], -1)
        visible = module.get_visible_tokens(packed[..., -1].bool(), q_length=s, current_length=s)
        pool_keys, pool_idx, pool_valid = module.get_pooled_states(packed)
        scores = F.relu(torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1)) * module.softmax_scale)
        weights = module.weights_proj(hs).float() * module.n_heads**-0.5
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)[0]  # [S, P]
        ends = pool_idx[0, :, -1].clamp(0, s - 1)
        candidate = visible[0][:, ends] & pool_valid[0][None]
        k_sel = module.index_topk // module.index_kpool
        gap = torch.full((s,), float("inf"))
        for t in range(s):
            vals = index_scores[t][candidate[t]]
            if vals.numel() > k_sel:
                top = vals.topk(k_sel + 1).values
                gap[t] = (top[k_sel - 1] - top[k_sel]) / top[0].abs().clamp(min=1e-6)
        out.append(gap)

    return hook


@dataclass
class Comparison:
    compared: int
    excused: int


def check_continuation(ref: Reference, prompt: list[int], tokens: list[int], logprobs: list[dict[int, float]]) -> Comparison:
    """Teacher forcing: each generated token must be HF's argmax (to LOGIT_TOL) with HF's logprob."""
    logits, first_tie, _ = teacher_forced(ref, prompt + tokens)
    compared = 0
    for i, token in enumerate(tokens):
        pos = len(prompt) - 1 + i
        if pos >= first_tie:
            break
        row = logits[pos]
        scale = max(1.0, float(row.abs().max()))
        assert float(row.max() - row[token]) <= LOGIT_TOL * scale, (
            f"step {i}: token {token} is not HF's argmax {int(row.argmax())} (gap {float(row.max() - row[token]):.3g})"
        )
        hf_logprob = float(torch.log_softmax(row, -1)[token])
        assert abs(logprobs[i][token] - hf_logprob) <= LOGPROB_TOL, (
            f"step {i}: logprob {logprobs[i][token]:.6f} vs HF {hf_logprob:.6f}"
        )
        compared += 1
    return Comparison(compared=compared, excused=len(tokens) - compared)
