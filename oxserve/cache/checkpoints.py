"""Which KDA state checkpoints to keep: the bookkeeping of the checkpoint pool. No tensors.

A checkpoint is every KDA layer's conv and recurrent state at one position of one prefix,
in a row of the checkpoint store (`oxserve.cache.store`). It is keyed by the hash of the
full blocks before that position plus the tokens after them (its `tail`, shorter than a
block), and it pins the partial block that holds the tail's MLA entries, so a prompt that
starts with the same tokens resumes there at any length, copying that one block.

Eviction, when the pool is full (`policy`):

    lru      the least recently used checkpoint
    marconi  the lowest  recency + alpha * efficiency,  both scaled to [0, 1] over the pool:
             recency by last use, efficiency = prefill work a hit saves / bytes it holds
             (Marconi, Pan et al. 2025): a long prefix's state is worth more than a short
             one's of the same size, and stale ones still go. Ties go least recently used.

Checkpoints used or added in the current step are never evicted in it: their rows are read
or written by this step's cache operations.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("marconi", "lru")


@dataclass
class Checkpoint:
    id: int  # its row in the checkpoint store
    parent: bytes  # hash of the full blocks before `position`
    tail: tuple[int, ...]  # the tokens after them, up to `position`
    position: int
    block: int | None  # the partial block holding the tail's entries, pinned (None: block-aligned)
    saved_cost: float  # prefill work a hit saves
    bytes: int  # memory it holds (its state rows, and its pinned block)
    last_used: int  # step of its last save or hit
    hits: int = 0


class CheckpointIndex:
    def __init__(self, capacity: int, policy: str = "marconi", alpha: float = 1.0):
        if policy not in POLICIES:
            raise ValueError(f"checkpoint policy must be one of {POLICIES}, got {policy!r}")
        self.capacity = capacity
        self.policy = policy
        self.alpha = alpha
        self._free_ids: deque[int] = deque(range(capacity))
        self._by_parent: dict[bytes, list[Checkpoint]] = {}
        self.live: dict[int, Checkpoint] = {}
        self.step = 0  # advanced once per engine step
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.live)

    def find(self, parent: bytes, upcoming: Sequence[int], max_tail: int) -> Checkpoint | None:
        """The checkpoint after `parent` with the longest tail that `upcoming` starts with."""
        best = None
        for c in self._by_parent.get(parent, ()):
            n = len(c.tail)
            if n <= max_tail and (best is None or n > len(best.tail)) and tuple(upcoming[:n]) == c.tail:
                best = c
        return best

    def tails_after(self, parent: bytes) -> list[tuple[int, ...]]:
        return [c.tail for c in self._by_parent.get(parent, ())]

    def exact(self, parent: bytes, tail: tuple[int, ...]) -> Checkpoint | None:
        return next((c for c in self._by_parent.get(parent, ()) if c.tail == tail), None)

    def use(self, c: Checkpoint) -> None:
        c.last_used = self.step
        c.hits += 1

    def add(self, parent: bytes, tail: tuple[int, ...], position: int, block: int | None, saved_cost: float,
            nbytes: int) -> Checkpoint:
        """A new checkpoint in a free row (the caller evicts first when there is none)."""
        c = Checkpoint(self._free_ids.popleft(), parent, tail, position, block, saved_cost, nbytes, self.step)
        self.live[c.id] = c
        self._by_parent.setdefault(parent, []).append(c)
        return c

    def evict(self, among: list[Checkpoint]) -> Checkpoint | None:
        """Remove the policy's choice among `among` (those used this step excepted) and return
        it, so the caller can unpin its block; None if all of them are in use this step."""
        victim = self._victim([c for c in among if c.last_used < self.step])
        if victim is not None:
            self.remove(victim)
            self.evictions += 1
        return victim

    def remove(self, c: Checkpoint) -> None:
        del self.live[c.id]
        siblings = self._by_parent[c.parent]
        siblings.remove(c)
        if not siblings:
            del self._by_parent[c.parent]
        self._free_ids.append(c.id)

    def _victim(self, candidates: list[Checkpoint]) -> Checkpoint | None:
        if not candidates:
            return None
        if self.policy == "lru":
            return min(candidates, key=lambda c: c.last_used)
        oldest = min(c.last_used for c in candidates)
        span = max(c.last_used for c in candidates) - oldest or 1
        best_efficiency = max(c.saved_cost / c.bytes for c in candidates) or 1.0

        def utility(c: Checkpoint) -> tuple[float, int]:
            return (c.last_used - oldest) / span + self.alpha * (c.saved_cost / c.bytes) / best_efficiency, c.last_used

        return min(candidates, key=utility)
