"""ReplaySSM bookkeeping on the host: how many entries each state slot's ring holds.

Every KDA layer's ring advances in step (one entry per decode token), so one count per slot
serves them all, and the kernels are told the counts rather than reading them back:

    decode token      count c -> c + 1; a full ring (c == R) is folded first: R -> 1
    prefill chunk     pending entries are folded before it reads the state; it writes the
                      full state, so the ring is empty after it: c -> 0
    verified tokens   a token and its drafts append one entry each (a ring that would
                      overflow is folded first)
    rejected tokens   (speculative decoding) the count moves back; nothing else changes
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RingCounts:
    """One step's ring counts, before the step, in batch order."""

    decodes: list[int]  # entries before each decode's token (the ring length: fold first)
    prefills: list[int]  # entries to fold before each prefill chunk reads its state
    decode_counts: torch.Tensor  # `decodes` as int64, on the device
    prefill_counts: torch.Tensor  # `prefills` as int64, on the device
    verifies: list[int] = ()  # entries before each verified run of tokens (fold first if it would overflow)
    # `verifies` as int64 on the device, and each run's first token (among the verified ones)
    # and length: what the kernels read, so that a captured step's replay can refill them.
    verify_counts: torch.Tensor | None = None
    verify_starts: torch.Tensor | None = None
    verify_lens: torch.Tensor | None = None


class ReplayBook:
    def __init__(self, num_slots: int, length: int):
        if length < 1:
            raise ValueError(f"the replay ring needs at least one entry, got {length}")
        self.length = length
        self.counts = [0] * num_slots

    def advance(self, slots: list[int], has_context: list[bool], num_decodes: int, device,
                verify_lens: tuple[int, ...] = ()) -> RingCounts:
        """Counts for a step whose first `num_decodes` requests decode one token each and
        whose next len(verify_lens) requests run that many tokens each as decode steps (a
        token and its drafts), and the book after it. A run that would overflow its ring
        folds it first."""
        decodes, verifies, prefills = self.advance_decodes(slots[:num_decodes]), [], []
        verify_slots = slots[num_decodes : num_decodes + len(verify_lens)]
        for slot, n in zip(verify_slots, verify_lens):
            if n > self.length:
                raise ValueError(f"{n} tokens to verify do not fit a replay ring of {self.length}")
            before = self.counts[slot]
            verifies.append(before)
            self.counts[slot] = (0 if before + n > self.length else before) + n
        rest = num_decodes + len(verify_lens)
        for slot, context in zip(slots[rest:], has_context[rest:]):
            prefills.append(self.counts[slot] if context else 0)
            self.counts[slot] = 0
        return ring_counts(decodes, prefills, verifies, verify_lens, device)

    def advance_decodes(self, slots: list[int]) -> list[int]:
        """The counts before a decode of one token in each of `slots`, in order (a full ring
        folds first), and the book after them."""
        decodes = []
        for slot in slots:
            before = self.counts[slot]
            decodes.append(before)
            self.counts[slot] = (0 if before == self.length else before) + 1
        return decodes

    def rollback(self, slot: int, rejected: int) -> None:
        """Forget the last `rejected` entries of a slot's ring (rejected draft tokens)."""
        self.counts[slot] -= rejected


def ring_counts(decodes: list[int], prefills: list[int], verifies: list[int], verify_lens, device) -> RingCounts:
    """A step's counts (`ReplayBook.advance`), with their tensors; `verify_lens`: the length of
    each verified run."""

    def as_long(values) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=device)

    runs = ()
    if verifies:
        starts = list(itertools.accumulate(verify_lens, initial=0))[:-1]
        runs = as_long(verifies), as_long(starts), as_long(verify_lens)
    return RingCounts(decodes, prefills, as_long(decodes), as_long(prefills), verifies, *runs)
