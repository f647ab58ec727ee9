"""Trains the default model on the Python standard library's own source, MTP layer included.

Every machine with Python has the corpus, so the run is reproducible from this file alone:
fixed seeds, a fixed number of steps, the files in sorted order. It trains transformers'
`Glm5NextForConditionalGeneration` (the reference the parity tests use, so the weights mean
the same thing in both stacks) plus an MTP layer of the shape GLM-5.3-Flash ships, with the
DeepSeek-V3 objective: the main next-token loss plus `mtp_weight` times the MTP layer's loss
on the token after next. Routed experts are balanced without an auxiliary loss, as in
DeepSeek-V3: after each step every router's selection bias moves by `bias_rate` towards the
experts that were picked less than average.

transformers (a test dependency) is needed here, nowhere else in the default model.
Run with `oxserve build-default-model --train --out DIR`; the committed checkpoint in
`oxserve/default_model/trained/` was made that way (its `training.json` says how).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .build import (
    EOS_TOKEN,
    TOKEN_IDS,
    _write_json,
    corpus_files,
    generation_config,
    make_text_config,
    model_config,
    tensor_specs,
    tokenizer_config,
    train_tokenizer,
)

# Small enough to commit (about 30 MB in bf16) and to train in under an hour on 2 cores;
# GLM-5.3-Flash's structure kept: 3:1 KDA:MLA+DSA, a dense first layer, sigmoid-routed
# experts with a shared one, 4-stream hyper-connections.
TRAINED_SHAPE: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "intermediate_size": 512,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "index_n_heads": 2,
    "index_head_dim": 32,
    "linear_num_heads": 4,
    "linear_head_dim": 64,
}

# Not code a model should learn from, or not the language's everyday use.
_EXCLUDED_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "dist-packages",
                  "ensurepip", "pydoc_data", "__pycache__"}


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 1200
    batch: int = 4
    seq_len: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 60
    weight_decay: float = 0.1
    clip: float = 1.0
    mtp_weight: float = 0.3
    bias_rate: float = 1e-3
    seed: int = 0
    threads: int = 2
    log_every: int = 25


# ---- corpus ---------------------------------------------------------------------------


def stdlib_files() -> list[Path]:
    """The standard library's .py files, sorted, without tests, demos and vendored packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not _EXCLUDED_DIRS & set(p.relative_to(root).parts))


def is_held_out(path: Path) -> bool:
    """One file in 20, by a hash of its path inside the stdlib: never trained on."""
    rel = path.relative_to(sysconfig.get_paths()["stdlib"]).as_posix()
    return hashlib.blake2b(rel.encode(), digest_size=4).digest()[0] % 20 == 0


def source_text(path: Path) -> str | None:
    """A source file's text; None for one that is not UTF-8 (a few test fixtures)."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def token_stream(tokenizer, files: list[Path]) -> torch.Tensor:
    """Every file's tokens followed by end-of-text, one long stream."""
    texts = [t for t in (source_text(p) for p in files) if t]
    eos = TOKEN_IDS[EOS_TOKEN]
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


@functools.lru_cache(maxsize=4)
def held_out_tokens(model_dir: str | Path) -> np.ndarray:
    """The held-out stdlib files in the tokenizer of the model at `model_dir`: code the
    trained default model never saw (realistic prompts for tests and workloads)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return token_stream(tokenizer, [p for p in stdlib_files() if is_held_out(p)]).numpy()


def held_out_windows(model_dir: str | Path, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` windows of `length` held-out tokens, at random places (seeded)."""
    tokens = held_out_tokens(model_dir)
    starts = torch.randint(0, len(tokens) - length, (count,), generator=torch.Generator().manual_seed(seed))
    return [tokens[s : s + length].tolist() for s in starts.tolist()]


# ---- the chunked KDA the training runs on -------------------------------------------------


def chunk_kda(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **_):
    """transformers' `chunk_kimi_delta_attention`, same math and signature, fast to train
    (chunks of 16 whatever `chunk_size` says: the factoring below needs short chunks).

    The reference builds [chunk, chunk, d_k] decay tensors and inverts the WY matrix row by row;
    here exp(g_i - g_j) is factored around each chunk's middle (each factor within
    exp(±8·|log-decay per step|), finite in fp32 for GLM's lower bound of -5) so both
    intra-chunk products are matmuls, and the inverse is one triangular solve.
    """
    from transformers.models.glm5_next.modeling_glm5_next import l2norm

    size = 16
    dtype = query.dtype
    q, k, v, beta, g = (x.transpose(1, 2).to(torch.float32) for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q, dim=-1, eps=1e-6), l2norm(k, dim=-1, eps=1e-6)
    b, h, t, dk = k.shape
    pad = (size - t % size) % size
    q = F.pad(q, (0, 0, 0, pad)) * dk**-0.5
    k, v, g = (F.pad(x, (0, 0, 0, pad)) for x in (k, v, g))
    n = (t + pad) // size
    q, k, v, g = (x.reshape(b, h, n, size, x.shape[-1]) for x in (q, k, v, g))
    beta = F.pad(beta, (0, pad)).reshape(b, h, n, size, 1)
    g = g.cumsum(-2)
    middle = g[..., size // 2 : size // 2 + 1, :]
    k_in, decay_out = k * (middle - g).exp(), (g - middle).exp()
    k_beta = k * beta
    ones = torch.ones(size, size, dtype=torch.bool, device=q.device)
    a = ((k_beta * decay_out) @ k_in.transpose(-1, -2)).masked_fill(~ones.tril(-1), 0)
    eye = torch.eye(size, device=q.device)
    wy = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
    u, w = wy @ (v * beta), wy @ (k_beta * g.exp())
    intra = ((q * decay_out) @ k_in.transpose(-1, -2)).masked_fill(~ones.tril(), 0)
    state = torch.zeros(b, h, dk, v.shape[-1], device=q.device) if initial_state is None else initial_state.float()
    outs = []
    for i in range(n):
        gi = g[:, :, i]
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append((q[:, :, i] * gi.exp()) @ state + intra[:, :, i] @ v_new)
        last = gi[:, :, -1:]
        state = state * last.transpose(-1, -2).exp() + (k[:, :, i] * (last - gi).exp()).transpose(-1, -2) @ v_new
    out = torch.stack(outs, 2).reshape(b, h, n * size, -1)[:, :, :t].transpose(1, 2).contiguous().to(dtype)
    return out, (state if output_final_state else None)


# ---- the MTP layer, in transformers' building blocks --------------------------------------


class TrainingMTP(nn.Module):
    """oxserve.model.mtp.MTPLayer's math on transformers' modules, for training."""

    def __init__(self, text_config, full_indexer_layer: int):
        from transformers.models.glm5_next import modeling_glm5_next as hf

        super().__init__()
        d, eps = text_config.hidden_size, text_config.rms_norm_eps
        self.enorm = hf.Glm5NextTextRMSNorm(d, eps)
        self.hnorm = hf.Glm5NextTextRMSNorm(d, eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.input_layernorm = hf.Glm5NextTextRMSNorm(d, eps)
        # an index whose indexer is "full": the layer then owns its indexer, as the MTP layer does
        self.self_attn = hf.Glm5NextTextAttention(text_config, full_indexer_layer)
        self.post_attention_layernorm = hf.Glm5NextTextRMSNorm(d, eps)
        self.mlp = hf.Glm5NextTextMoE(text_config)
        self.shared_head_norm = hf.Glm5NextTextRMSNorm(d, eps)

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """next_embeds, hidden [B, T, D] -> normed [B, T, D] for the shared head."""
        next_embeds = next_embeds.clone()
        next_embeds[:, 0] = 0.0  # position 0 sees no embedding, as at serving time
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        mask = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
        attn, _, _ = self.self_attn(hidden_states=self.input_layernorm(x), attention_mask=mask,
                                    position_ids=None, position_embeddings=None)
        y = x + attn
        z = y + self.mlp(self.post_attention_layernorm(y))
        return self.shared_head_norm(z)

    def checkpoint_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Its weights under the checkpoint's names (per-expert projections, `shared_head.norm`)."""
        out = {}
        for name, value in self.state_dict().items():
            if name == "mlp.experts.gate_up_proj":
                gate, up = value.chunk(2, dim=1)
                for e in range(value.shape[0]):
                    out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate[e]
                    out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up[e]
            elif name == "mlp.experts.down_proj":
                for e in range(value.shape[0]):
                    out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = value[e]
            else:
                out[prefix + name.replace("shared_head_norm", "shared_head.norm")] = value
        return out


# ---- training -------------------------------------------------------------------------


class ExpertBalance:
    """DeepSeek-V3's auxiliary-loss-free balancing: count each router's picks in a step, then
    move its selection bias by `rate` towards the experts picked less than average."""

    def __init__(self, model: nn.Module, rate: float):
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextTopkRouter

        self.rate = rate
        self.counts: dict[nn.Module, torch.Tensor] = {}
        for module in model.modules():
            if isinstance(module, Glm5NextTextTopkRouter):
                module.register_forward_hook(self._count)

    def _count(self, router, _args, result) -> None:
        picks = torch.bincount(result[2].flatten(), minlength=router.num_experts).float()
        self.counts[router] = self.counts.get(router, 0) + picks

    @torch.no_grad()
    def update(self) -> None:
        for router, counts in self.counts.items():
            router.e_score_correction_bias += self.rate * torch.sign(counts.mean() - counts)
        self.counts.clear()


def _lr(step: int, s: TrainSettings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _losses(model, mtp: TrainingMTP, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forced next-token and MTP (token after next) cross-entropies of [B, T+2]
    windows, and the MTP logits [B, T, V]."""
    tokens, next_tokens, after_next = window[:, :-2], window[:, 1:-1], window[:, 2:]
    text = model.model.language_model
    hidden = text(input_ids=tokens).last_hidden_state
    main = F.cross_entropy(model.lm_head(hidden).flatten(0, 1), next_tokens.flatten())
    drafted = model.lm_head(mtp(text.embed_tokens(next_tokens), hidden))
    extra = F.cross_entropy(drafted.flatten(0, 1), after_next.flatten())
    return main, extra, drafted


def _windows(stream: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length, (count,), generator=generator)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model, mtp: TrainingMTP, stream: torch.Tensor, s: TrainSettings, batches: int = 8) -> dict[str, float]:
    """Held-out losses and the MTP layer's top-1 accuracy on the token after next."""
    generator = torch.Generator().manual_seed(s.seed + 1)
    totals = {"loss": 0.0, "mtp_loss": 0.0, "mtp_top1": 0.0}
    model.eval()
    mtp.eval()
    for _ in range(batches):
        window = _windows(stream, s.batch, s.seq_len + 2, generator)
        main, extra, drafted = _losses(model, mtp, window)
        totals["loss"] += main.item() / batches
        totals["mtp_loss"] += extra.item() / batches
        totals["mtp_top1"] += (drafted.argmax(-1) == window[:, 2:]).float().mean().item() / batches
    model.train()
    mtp.train()
    return totals


def train(out_dir: str | Path, settings: TrainSettings = TrainSettings(), log=print) -> Path:
    """Trains and writes the checkpoint (bf16, MTP layer included) plus `training.json`."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
    from transformers.models.glm5_next import modeling_glm5_next as hf

    started = time.time()
    torch.manual_seed(settings.seed)
    torch.set_num_threads(settings.threads)
    files = stdlib_files()
    train_files = [p for p in files if not is_held_out(p)]
    held_out = [p for p in files if is_held_out(p)]
    tokenizer = train_tokenizer([*corpus_files(), *train_files])
    train_stream, held_stream = token_stream(tokenizer, train_files), token_stream(tokenizer, held_out)
    log(f"corpus: {len(train_files)} files, {train_stream.numel():,} tokens; held out {len(held_out)} files, "
        f"{held_stream.numel():,} tokens ({time.time() - started:.0f} s)")

    text = make_text_config(**TRAINED_SHAPE)
    config = model_config(text, torch.bfloat16)
    hf_config = Glm5NextConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type", "dtype")})
    hf.chunk_kimi_delta_attention = chunk_kda  # the layers look the function up by this name
    model = Glm5NextForConditionalGeneration(hf_config).train()
    full = next(i for i, t in enumerate(text["layer_types"]) if t != "linear_attention" and text["indexer_types"][i] == "full")
    mtp = TrainingMTP(hf_config.text_config, full).train()
    for module in mtp.modules():
        model.model.language_model._init_weights(module)  # transformers' own init for its modules
    balance = ExpertBalance(nn.ModuleList([model, mtp]), settings.bias_rate)
    params = [p for n, p in [*model.named_parameters(), *mtp.named_parameters()] if "visual" not in n]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=settings.lr, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(settings.seed)
    history = []
    tick = time.time()
    for step in range(settings.steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, settings)
        main, extra, _ = _losses(model, mtp, _windows(train_stream, settings.batch, settings.seq_len + 2, generator))
        (main + settings.mtp_weight * extra).backward()
        torch.nn.utils.clip_grad_norm_(params, settings.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        balance.update()
        if (step + 1) % settings.log_every == 0 or step + 1 == settings.steps:
            rate = settings.log_every * settings.batch * settings.seq_len / (time.time() - tick)
            history.append({"step": step + 1, "loss": main.item(), "mtp_loss": extra.item(), "elapsed_s": time.time() - started})
            log(f"step {step + 1}/{settings.steps}  loss {main.item():.3f}  mtp {extra.item():.3f}  "
                f"{rate:.0f} tok/s  {time.time() - started:.0f} s")
            tick = time.time()
    scores = evaluate(model, mtp, held_stream, settings)
    log(f"held out: loss {scores['loss']:.3f}  mtp loss {scores['mtp_loss']:.3f}  mtp top-1 {scores['mtp_top1']:.3f}")
    record = {
        "corpus": f"Python {sysconfig.get_python_version()} standard library source (stdlib_files(), "
        f"one file in 20 held out) and the shipped English corpus for the tokenizer",
        "train_files": len(train_files),
        "train_tokens": train_stream.numel(),
        "tokens_seen": settings.steps * settings.batch * settings.seq_len,
        "settings": asdict(settings),
        "held_out": scores,
        "wall_s": round(time.time() - started),
        "torch": torch.__version__,
        "history": history,
    }
    return write_checkpoint(out_dir, config, model, mtp, tokenizer, text, record)


def write_checkpoint(out_dir, config, model, mtp: TrainingMTP, tokenizer, text, record) -> Path:
    """bf16 weights under the checkpoint's names (float32 where HF keeps them so), MTP layer
    as layer `num_hidden_layers`, with config, tokenizer and the training record."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)  # transformers writes the checkpoint form (per-expert names)
        with safe_open(str(Path(tmp) / "model.safetensors"), "pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    tensors.update(mtp.checkpoint_tensors(f"model.language_model.layers.{text['num_hidden_layers']}."))
    specs = {spec.name: spec for spec in tensor_specs(config, mtp=True)}
    if set(specs) != set(tensors):
        raise RuntimeError(f"checkpoint names differ from the builder's: {sorted(set(specs) ^ set(tensors))[:8]}")
    weights = {}
    for name, spec in specs.items():
        if tuple(tensors[name].shape) != spec.shape:
            raise RuntimeError(f"{name}: trained {tuple(tensors[name].shape)}, expected {spec.shape}")
        weights[name] = tensors[name].to(torch.float32 if spec.fp32 else torch.bfloat16).contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config())
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(text))
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return out
