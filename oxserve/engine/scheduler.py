"""Continuous batching under a token budget; preemption by recompute.

Each step: running requests first, in arrival order, each gets min(uncomputed, budget left)
tokens (1 for a decode, a chunk for a prefill). If the cache cannot hold a request's next
tokens, the latest-arrived running request is preempted: its blocks and slot are freed and it
goes back to the front of the queue, to be recomputed from scratch later. Waiting requests
are admitted while budget, `max_num_seqs` and cache allow, oldest first.

The scheduler decides; it never touches tensors. Its output is one plain `SchedulerOutput`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from oxserve.cache.manager import CacheManager
from oxserve.config import SchedulerConfig
from oxserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_ids: list[int]
    state_slot: int

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.request.num_computed_tokens > 0

    @property
    def completes_sequence(self) -> bool:
        """True when this step computes the request's last uncomputed token, so a new one is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # decodes first, then prefill chunks
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager):
        self.config = config
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        # Deterministic mode feeds every request token by token: the same computation for a
        # token whatever the chunking or preemption history.
        step_cap = 1 if self.config.deterministic else budget
        chosen: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_uncomputed, budget, step_cap)
            if n == 0:  # nothing new to compute (cannot happen while the engine samples each step)
                i += 1
                continue
            while not self.cache.can_grow(request.request_id, request.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                self.cache.grow(request.request_id, request.num_computed_tokens + n)
                chosen.append((request, n))
                budget -= n
                i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            request = self.waiting[0]
            n = min(request.num_uncomputed, budget, step_cap)
            if not self.cache.can_grow(request.request_id, request.num_computed_tokens + n):
                break
            self.waiting.popleft()
            self.cache.grow(request.request_id, request.num_computed_tokens + n)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chosen.append((request, n))
            budget -= n
        scheduled = [
            ScheduledRequest(r, n, list(self.cache.blocks_of(r.request_id)), self.cache.slot_of(r.request_id))
            for r, n in chosen
        ]
        scheduled.sort(key=lambda s: not s.is_decode)  # stable: decodes first, arrival order kept
        return SchedulerOutput(scheduled=scheduled, preempted=preempted)

    def _preempt(self, request: Request) -> None:
        self.cache.release(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Take a finished or aborted request out and free what it holds."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.cache.release(request.request_id)
