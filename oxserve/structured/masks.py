"""The allowed-token mask of a batch, and the per-request grammar state behind it.

Per step: every constrained row's matcher writes its bitmask into one int32 tensor
[rows, ceil(V/32)] (bit j of word w allows token 32w + j), computed by llguidance's thread
pool for the whole batch at once; then the disallowed logits are set to -inf in one pass
(`oxserve.kernels.token_mask`). Unconstrained rows are never touched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import llguidance as llg
import torch

from oxserve.kernels.token_mask import apply_token_bitmask
from oxserve.structured.params import StructuredOutputs


@dataclass
class RequestGrammar:
    """A request's matcher, and whether it has started (see StructuredOutputs.after_token_id)."""

    matcher: llg.LLMatcher
    waiting_for: int | None  # the token that starts the constraint; None once started

    @staticmethod
    def of(constraint: StructuredOutputs, matcher: llg.LLMatcher) -> RequestGrammar:
        return RequestGrammar(matcher, constraint.after_token_id)

    @property
    def active(self) -> bool:
        return self.waiting_for is None

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token (a token the mask allowed, so it always matches)."""
        if self.waiting_for is not None:
            if token_id == self.waiting_for:
                self.waiting_for = None
            return
        if self.matcher.is_stopped():  # complete: only EOS is allowed, which ignore_eos may repeat
            return
        if not self.matcher.consume_token(token_id):
            raise RuntimeError(f"grammar rejected a token its own mask allowed: {self.matcher.get_error()}")


class BatchMasks:
    """Applies the batch's grammar masks to its logits, in place."""

    def __init__(self, vocab_size: int, threads: int | None = None):
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.executor = llg.LLExecutor(threads)
        self.cost = MaskCost()

    def apply(self, logits: torch.Tensor, grammars: list[RequestGrammar | None]) -> None:
        """`logits` [R, V]; row i is constrained when grammars[i] is active."""
        rows = [i for i, g in enumerate(grammars) if g is not None and g.active]
        if not rows:
            return
        started = time.perf_counter()
        bitmask = torch.empty(len(rows), self.words, dtype=torch.int32)
        self.executor.unsafe_compute_mask_ptr(
            [(grammars[i].matcher, k) for k, i in enumerate(rows)], bitmask.data_ptr(), self.words * 4, len(rows)
        )
        apply_token_bitmask(logits, rows, bitmask)
        self.cost.add(time.perf_counter() - started, len(rows))


@dataclass
class MaskCost:
    """What the masks have cost so far: for /metrics and `bench serve`'s per-step figure."""

    seconds: float = 0.0
    steps: int = 0  # steps that masked at least one row
    rows: int = 0

    def add(self, seconds: float, rows: int) -> None:
        self.seconds += seconds
        self.steps += 1
        self.rows += rows
