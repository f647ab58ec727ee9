"""How far a quantized model's next-token distributions are from the unquantized model's.

Teacher-forced: both models score the same token sequences (calibration or held-out text)
at every position, so one number per position compares whole distributions:

    KL(p_ref || p_quant) = sum_v p_ref(v) (log p_ref(v) - log p_quant(v))     (nats/token)

plus how often the two models' top-1 choices agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Agreement:
    mean_kl: float  # nats per token
    max_kl: float
    top1: float  # fraction of positions where both models' argmax agree
    positions: int

    def __str__(self) -> str:
        return f"mean KL {self.mean_kl:.2e} nats/token (max {self.max_kl:.2e}), top-1 agreement {self.top1:.2%} over {self.positions} positions"


def agreement(reference: list[torch.Tensor], candidate: list[torch.Tensor]) -> Agreement:
    ref = torch.cat(reference).float().log_softmax(-1)
    cand = torch.cat(candidate).float().log_softmax(-1)
    kl = (ref.exp() * (ref - cand)).sum(-1).clamp(min=0)  # rounding can make a near-zero KL negative
    top1 = (ref.argmax(-1) == cand.argmax(-1)).float().mean()
    return Agreement(float(kl.mean()), float(kl.max()), float(top1), int(kl.numel()))


def calibration_sequences(tokenizer, text: str, count: int, length: int) -> list[list[int]]:
    """`count` token sequences of `length` taken from evenly spaced places in `text`."""
    ids = tokenizer.encode(text)
    if len(ids) < length:
        raise ValueError(f"calibration text has {len(ids)} tokens, fewer than one sequence of {length}")
    stride = max(1, (len(ids) - length) // max(1, count - 1))
    starts = [min(i * stride, len(ids) - length) for i in range(count)]
    return [ids[s : s + length] for s in starts]


def shipped_calibration_text(code_files: int = 40) -> str:
    """Text like the default model's training data: the shipped English corpus and the first
    `code_files` standard library files it was trained on (never its held-out files)."""
    from oxserve.default_model.train import is_held_out, source_text, stdlib_files

    english = (Path(__file__).parents[1] / "default_model" / "corpus.txt").read_text()
    files = [p for p in stdlib_files() if not is_held_out(p)][:code_files]
    code = [source_text(p) or "" for p in files]
    return "\n".join([english, *code])
