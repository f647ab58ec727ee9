"""The glm5_next text decoder on a flat packed batch (see `ForwardBatch`).

With tensor parallelism (`oxserve.parallel.tensor`) each block's output is a partial sum,
reduced here, once per attention and once per MLP; the embedding and head are cut by
vocabulary, and only the first rank gets logits. Under Layer Split
(`oxserve.parallel.layer_split`) an MLA layer's attention runs on its owner alone, which
shares the output with the other ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from oxserve.cache.layers import LayerCache
from oxserve.cache.precision import CachePlan
from oxserve.cache.spec import ElsewhereCacheSpec, LayerCacheSpec
from oxserve.kernels.norm import mean_rms_norm
from oxserve.kernels.onednn import PanelLinear
from oxserve.kernels.rows import repeated_embedding
from oxserve.model.batch import ForwardBatch
from oxserve.model.common import DenseMLP, RMSNorm
from oxserve.model.config import TextModelConfig
from oxserve.model.hyper import HyperConnection
from oxserve.model.kda import KDAttention
from oxserve.model.linear import Linear, empty_param, loadable
from oxserve.model.mla import MLAttention
from oxserve.model.moe import MoE
from oxserve.model.mtp import MTPLayer
from oxserve.parallel.layer_split import WHOLE, LayerSplit, layer_owners
from oxserve.parallel.tensor import SINGLE, TensorParallel
from oxserve.telemetry import Tracer, span


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextModelConfig, index: int, tp: TensorParallel = SINGLE, ls: LayerSplit = WHOLE,
                 owner: int | None = None):  # fmt: skip
        super().__init__()
        self.name = f"L{index}"
        self.tp = tp
        self.ls, self.owner = ls, owner  # owner: the Layer Split rank that runs this attention (None: every rank)
        self.is_mla = cfg.is_mla_layer(index)
        if self.is_mla:
            self.self_attn = MLAttention(cfg, cfg.is_full_indexer_layer(index), f"L{index}.mla", tp)
        else:
            self.self_attn = KDAttention(cfg, f"L{index}.kda", tp)
        self.sparse = cfg.mlp_layer_types[index] == "sparse"
        if self.sparse:
            self.mlp = MoE(cfg, f"L{index}.moe", tp)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.swiglu_limit, cfg.hidden_act, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hc = (cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(
        self, streams: torch.Tensor, batch: ForwardBatch, cache: LayerCache, selection: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tracer = batch.tracer
        with span(tracer, f"{self.name}.hc.collapse"):
            post, comb, x = self.attn_hc.collapse(streams, self.input_layernorm)
        if not self.ls.owns(self.owner):  # another rank holds this layer's cache and runs it
            x, selection = torch.empty_like(x), None
        elif self.is_mla:
            x, selection = self.self_attn(x, batch, cache, selection)
            x = self.tp.reduce(x)
        else:
            x, selection = self.tp.reduce(self.self_attn(x, batch, cache)), None
        if self.owner is not None:  # Layer Split: the owner's output on every rank
            with span(tracer, f"{self.name}.layer_split.share"):
                x = self.ls.share(x, self.owner)
        with span(tracer, f"{self.name}.hc.expand"):
            streams = HyperConnection.expand(post, comb, x, streams)
        with span(tracer, f"{self.name}.hc.collapse"):
            post, comb, x = self.ffn_hc.collapse(streams, self.post_attention_layernorm)
        if self.sparse:
            x = self.mlp(x, tracer)
        else:
            with span(tracer, f"{self.name}.mlp.dense"):
                x = self.mlp(x)
        x = self.tp.reduce(x)
        with span(tracer, f"{self.name}.hc.expand"):
            return HyperConnection.expand(post, comb, x, streams), selection


class Glm5NextForCausalLM(nn.Module):
    """The decoder. With `with_mtp`, also the checkpoint's MTP layer (a drafter for
    speculative decoding that shares this model's embedding and head)."""

    def __init__(self, cfg: TextModelConfig, with_mtp: bool = False, tp: TensorParallel = SINGLE, ls: LayerSplit = WHOLE):
        super().__init__()
        self.config = cfg
        self.tp, self.ls = tp, ls
        self.owners = layer_owners(cfg, ls.size)
        vocab_rows = tp.vocab_rows(cfg.vocab_size)  # this rank's slice: [rank * rows, (rank + 1) * rows)
        self.embed_tokens = loadable(empty_param(vocab_rows, cfg.hidden_size), split=tp.split(-2, pad=True))
        # Every rank builds (and loads) every layer, owned or not: ranks hold the same shapes.
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, ls, self.owners[i]) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # A Linear, so that quantization and kernel choices (swap_linears) reach the head too.
        # Tied: the embedding's parameter is the head's weight (the reference ties on the
        # top-level flag only).
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, tp, "vocab")
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens
        self.mtp = MTPLayer(cfg, cfg.num_hidden_layers, tp) if with_mtp else None

    def cache_specs(self, dtype: torch.dtype, plan: CachePlan | None = None, kda_replay: int = 0,
                    ls_rank: int | None = None) -> list[LayerCacheSpec]:  # fmt: skip
        """What each decoder layer caches, in layer order, stored as `plan` says (default:
        the model's dtype; fp32 KDA states). `kda_replay`: KDA layers' ReplaySSM ring
        length (0: write-back decode). Under Layer Split, what Layer Split rank `ls_rank`
        (default: this one) caches: nothing for the layers other ranks own."""
        plan = plan or CachePlan()
        ls_rank = self.ls.rank if ls_rank is None else ls_rank

        def spec(i: int, attn: nn.Module) -> LayerCacheSpec:
            if self.owners[i] not in (None, ls_rank):
                return ElsewhereCacheSpec()
            if isinstance(attn, KDAttention):
                return attn.cache_spec(dtype, plan.for_layer(i), kda_replay)
            return attn.cache_spec(dtype, plan.for_layer(i))

        return [spec(i, layer.self_attn) for i, layer in enumerate(self.layers)]

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, caches: list[LayerCache],
                all_rows: bool = False, mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
        """input_ids [T] -> final hidden states of the rows in batch.logits_indices [S, D]
        (with `all_rows`, of every row [T, D]: the MTP drafter reads them all). `mm_embeds`:
        (rows, embeddings) that replace those rows' token embeddings (images, video)."""
        with span(batch.tracer, "embed"):
            streams = self.embed_streams(input_ids, mm_embeds)
        selection = None
        for layer, cache in zip(self.layers, caches):
            streams, selection = layer(streams, batch, cache, selection)
        with span(batch.tracer, "final_norm"):
            if all_rows:
                return self.norm(streams.mean(1))
            return mean_rms_norm(streams, batch.logits_indices, self.norm.weight, self.norm.eps)

    def embed_streams(self, input_ids: torch.Tensor, mm_embeds: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The token embeddings (`mm_embeds`' rows replaced), one copy per hyper-connection
        stream: [T, hc_mult, D]."""
        if self.tp.size == 1 and mm_embeds is None:
            return repeated_embedding(self.embed_tokens, input_ids, self.config.hc_mult)
        x = self.embed(input_ids)
        if mm_embeds is not None:
            rows, embeds = mm_embeds
            x[rows] = embeds.to(x.dtype)
        return x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:  # (a native row gather on CPU: a torch op in a captured step runs cold)
            return repeated_embedding(self.embed_tokens, input_ids, 1).squeeze(-2)
        rows = self.embed_tokens.shape[0]
        local = input_ids - self.tp.rank * rows
        mine = (local >= 0) & (local < rows)
        embeds = F.embedding(local.clamp(0, rows - 1), self.embed_tokens) * mine.unsqueeze(-1)
        return self.tp.reduce(embeds)

    def compute_logits(self, hidden: torch.Tensor, tracer: Tracer | None = None) -> torch.Tensor | None:
        """Logits [S, vocab] (fp32); under tensor parallelism or Layer Split on the first rank
        only (None elsewhere)."""
        if self.ls.rank != 0:  # the first Layer Split rank's TP group computes them for everyone
            return None
        with span(tracer, "lm_head"):
            head = self.lm_head
            logits = self.tp.gather_to_first(head.forward_float(hidden) if isinstance(head, PanelLinear) else head(hidden).float())
            return None if logits is None else logits[:, : self.config.vocab_size]
