"""What a prefix costs to prefill, for the prefix cache's eviction (compute saved per byte).

An estimate in FLOPs, from the loaded model: two per weight a token passes through (routed
experts at top_k / n_routed_experts of their weights; the embedding is a lookup and the LM
head runs only where logits are sampled), plus the MLA attention over the keys each token
reads (all earlier tokens, or index_topk of them where the DSA indexer selects).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain

from torch import nn

SKIPPED = ("embed_tokens", "lm_head", "mtp.")


def prefill_cost(model: nn.Module) -> Callable[[int], float]:
    cfg = model.config
    per_token = 0.0
    for name, tensor in chain(model.named_parameters(), model.named_buffers()):
        if tensor.dim() < 2 or name.startswith(SKIPPED):
            continue
        share = cfg.num_experts_per_tok / cfg.n_routed_experts if ".experts." in name else 1.0
        per_token += 2 * tensor.numel() * share
    # Absorbed MLA: scores and values over the latent width, per head.
    per_pair = 4 * cfg.num_attention_heads * cfg.kv_lora_rank * len(cfg.mla_layers)
    window = cfg.index_topk if cfg.full_indexer_layers else None

    def cost(n: int) -> float:
        if window is None or n <= window:
            pairs = n * (n - 1) / 2
        else:
            pairs = window * (window - 1) / 2 + (n - window) * window
        return per_token * n + per_pair * pairs

    return cost
