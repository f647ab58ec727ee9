"""Continuous batching under a token budget; preemption by recompute.

Each step: running requests first, in arrival order (with `scheduling_policy="priority"`: by
priority, then arrival), each gets min(uncomputed, budget left)
tokens (1 for a decode, plus its draft tokens if it has any; a chunk for a prefill). If the
cache cannot hold a request's next tokens, the last running request is preempted (the latest
arrived, or under the priority policy the least urgent):
its blocks and slot are freed and it goes back to the front of the queue, to be recomputed
from scratch later. Waiting requests are admitted while budget, `max_num_seqs` and cache
allow, oldest first. While decodes whose output is wanted as it comes run (any output kind
but FINAL_ONLY: every server request, streamed or not), the prefill tokens of a step are
bounded so that the step costs at most `max_stall` decode steps (stall-free batching, see
`pacing`).

When a step raises, its requests are recomputed from scratch, each alone in its steps until
it is past the failed step's tokens again (`quarantine`): a request that fails alone is the
one at fault and finishes with "error"; the others go on. One caught in `MAX_FAILED_STEPS`
failed steps runs alone until it finishes.

With prefix caching, a request is admitted at the longest prefix the cache holds (shared
blocks and a KDA checkpoint, see `oxserve.cache.manager`), and its prefill chunks end at the
positions where its own state is worth saving (`_checkpoint_targets`); finished, aborted
and preempted requests leave a checkpoint at their last computed token.

The scheduler decides and owns every change of request state; it never touches tensors.
`schedule()` returns one plain `SchedulerOutput`; `update_from_output()` takes the runner's
`ModelRunnerOutput` back: it advances `num_computed_tokens` (and rolls it back over rejected
draft tokens), appends the accepted tokens, checks token stops and retires what finished.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from oxserve.cache.manager import MIN_BRANCH_TOKENS, CacheManager, PrefixHit
from oxserve.config import SchedulerConfig
from oxserve.engine.interface import STEADY, ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput
from oxserve.engine.pacing import StepPacer
from oxserve.engine.request import Request, RequestStatus
from oxserve.engine.spec_guard import KEEP_FLOOR, PROBE_INTERVAL, DraftCost, draft_depth, record_verify
from oxserve.engine.stop import token_stop
from oxserve.sampling_params import RequestOutputKind


# A request in this many failed steps that never failed alone runs alone from then on: the
# fault depends on what it is batched with, and batching it again would loop.
MAX_FAILED_STEPS = 3


def _cut(request: Request, n: int) -> int:
    """A prefill chunk of n tokens, ended at the next position where the state is saved."""
    for position, _ in request.checkpoint_at:
        if position > request.num_computed_tokens:
            return min(n, position - request.num_computed_tokens)
    return n


def _insert_by_priority(queue: list[Request] | deque[Request], request: Request) -> None:
    key = (request.priority, request.arrival_time)
    at = next((i for i, r in enumerate(queue) if (r.priority, r.arrival_time) > key), len(queue))
    queue.insert(at, request)


@dataclass
class RequestUpdate:
    """What one step did to one request: the tokens (and logprobs) it accepted."""

    request: Request
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None

    @property
    def finished(self) -> bool:
        return self.request.is_finished


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager):
        self.config = config
        self.cache = cache
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_drafts = 0  # speculative decoding: steps that verified drafts for a request
        self.num_draft_tokens = 0  # draft tokens verified
        self.num_accepted_tokens = 0  # ... and kept
        self._finished_ids: list[str] = []  # retired since the last schedule(): the runner drops them
        self._requeued_ids: list[str] = []  # requeued since the last schedule() (`SchedulerOutput`)
        # Whether a request with its own seed left its blocks since the last schedule() (finished,
        # requeued), and since the one before: its owed MTP passes run in the next step (`drafting_dormant`)
        self._seeded_leaving = self._seeded_left = False
        self._blocks_sent: dict[str, int] = {}  # blocks of each running request the runner already has
        self.pacer = StepPacer(config.max_stall)
        self.draft_cost = DraftCost()  # speculative decoding: what a draft row costs at this batch size
        self._step_seconds: float | None = None  # the last step's wall time (observe_step)
        self._step_novelty = STEADY  # ... and what that says of its shape's steps to come
        # Priority policy: both queues ordered by (priority, arrival), so the running loop
        # serves the most urgent first and preemption takes the least urgent (the last).
        self.by_priority = config.scheduling_policy == "priority"

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._enqueue(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        suspect = self._suspect()
        chosen, preempted = self._choose(only=suspect)
        if suspect is not None and not chosen and not preempted:  # it cannot run now: the others can
            chosen, _ = self._choose(skip=suspect)
        new_requests = [
            NewRequestData(r.request_id, r.prompt_token_ids, r.params, r.token_slice(len(r.prompt_token_ids), r.num_computed_tokens),
                           r.mm_items)
            for r, _ in chosen if r.request_id not in self._blocks_sent
        ]  # fmt: skip
        scheduled = [self._scheduled(r, n) for r, n in chosen]
        decodes = [s.is_decode for s in scheduled]
        if not all(decodes[: decodes.count(True)]):  # stable: decodes first, arrival order kept
            scheduled = [s for s, d in zip(scheduled, decodes) if d] + [s for s, d in zip(scheduled, decodes) if not d]
        finished, self._finished_ids = self._finished_ids, []
        requeued, self._requeued_ids = self._requeued_ids, []
        self._seeded_left, self._seeded_leaving = self._seeded_leaving, False
        return SchedulerOutput(new_requests, scheduled, finished, self.cache.next_step(), requeued)

    def _choose(self, only: Request | None = None, skip: Request | None = None) -> tuple[list[tuple[Request, int]], bool]:
        """(request, tokens) for this step, and whether it preempted; with `only`, that
        request alone (a suspect after a failed step); `skip` is neither run nor admitted,
        nor is anything queued behind it."""
        budget = self.config.max_num_batched_tokens
        # Deterministic mode feeds every request token by token: the same computation for a
        # token whatever the chunking or preemption history.
        step_cap = 1 if self.config.deterministic else budget
        paced = None if self.config.deterministic else self.pacer.prefill_budget(self._watched_decodes(), self._prefill_backlog())
        prefill_left = budget if paced is None else paced
        chosen: list[tuple[Request, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request is skip or (only is not None and request is not only):
                i += 1
                continue
            uncomputed = request.num_uncomputed
            is_prefill = uncomputed > 1
            n = min(uncomputed + len(request.draft_token_ids), budget, step_cap)
            if request.draft_token_ids and not self.cache.can_grow(request.request_id, request.num_computed_tokens + n):
                request.draft_token_ids = []  # no room for the drafts: decode plainly rather than preempt for them
                n = min(uncomputed, budget, step_cap)
            if is_prefill:
                n = _cut(request, min(n, prefill_left))
                if n == 0:
                    i += 1
                    continue
            while not self.cache.can_grow(request.request_id, request.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                self.cache.grow(request.request_id, request.num_computed_tokens + n)
                chosen.append((request, n))
                budget -= n
                prefill_left -= n if is_prefill else 0
                i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            request = self.waiting[0]
            if request is skip or (only is not None and (request is not only or chosen)):
                break
            if request.imported_tokens:  # its prompt's caches came from a prefill instance: it decodes now
                if not self.cache.can_grow(request.request_id, request.num_tokens):
                    break
                self._admit_imported(request)
                chosen.append((request, 1))
                budget -= 1
                continue
            hit = self._prefix_hit(request)
            start = hit.position if hit is not None else 0
            n = min(request.num_tokens - start, budget, step_cap, prefill_left)
            if n == 0:
                break
            if not (self.cache.can_resume(hit, start + n) if start else self.cache.can_grow(request.request_id, n)):
                break
            self.waiting.popleft()
            if not (request.num_preemptions or request.num_failed_steps) and self.cache.prefix is not None and request.params.prompt_logprobs is None:
                self.cache.count_lookup(request.num_tokens - 1, start)
            if start:
                self.cache.resume(request.request_id, hit, start + n)
                request.num_computed_tokens = start
            else:
                self.cache.grow(request.request_id, n)
            request.checkpoint_at = self._checkpoint_targets(request, hit)
            n = _cut(request, n)
            request.status = RequestStatus.RUNNING
            if self.by_priority:
                _insert_by_priority(self.running, request)
            else:
                self.running.append(request)
            chosen.append((request, n))
            budget -= n
            prefill_left -= n
        return chosen, preempted

    def _watched_decodes(self) -> int:
        """Running decodes whose output is wanted as it comes (any output kind but FINAL_ONLY;
        the server never asks for FINAL_ONLY): the pacer bounds prefill for these. A request that wants its output only when it finishes (FINAL_ONLY: `LLM.generate`,
        offline batches) has no inter-token gaps to smooth, and holding prompts back for it only
        staggers the batch (requests start and finish one after another) and costs throughput."""
        return sum(1 for r in self.running
                   if r.num_uncomputed == 1 and r.params.output_kind is not RequestOutputKind.FINAL_ONLY)  # fmt: skip

    def _prefill_backlog(self) -> int:
        """Prompt tokens still to compute: of running prompts and of the waiting queue (whose
        imported requests bring their prompts' caches with them: nothing to compute)."""
        running = sum(r.num_uncomputed for r in self.running if r.num_uncomputed > 1)
        return running + sum(r.num_tokens - r.num_computed_tokens for r in self.waiting if not r.imported_tokens)

    def _admit_imported(self, request: Request) -> None:
        """Blocks and a slot for the imported prompt and its first output token, which the
        runner fills from the snapshot before the step; it is a decode from here on (and a
        recompute from scratch if preempted: the import is spent)."""
        self.waiting.popleft()
        self.cache.grow(request.request_id, request.num_tokens)
        request.num_computed_tokens, request.imported_tokens = request.imported_tokens, 0
        request.checkpoint_at = []
        request.status = RequestStatus.RUNNING
        if self.by_priority:
            _insert_by_priority(self.running, request)
        else:
            self.running.append(request)

    def _suspect(self) -> Request | None:
        """The first request still being recomputed alone after a failed step (running ones
        first: one suspect at a time)."""
        for request in (*self.running, *self.waiting):
            if request.isolate_until > request.num_computed_tokens:
                return request
        return None

    # ---- failure isolation ------------------------------------------------------------------
    def quarantine(self, scheduled: SchedulerOutput) -> list[Request]:
        """After `scheduled` raised in the runner: its requests' cache state may be half
        written, so none is checkpointed. A request alone in the step is finished with
        "error" (returned). Each other one goes back to the front of the queue, to be
        recomputed alone up to where this step would have taken it (after
        `MAX_FAILED_STEPS` failed steps: to its end)."""
        failed = []
        for s in reversed(scheduled.scheduled):  # appendleft: the queue keeps their order
            request = self.requests.get(s.request_id)
            if request is None or request.is_finished:
                continue
            request.num_failed_steps += 1
            if len(scheduled.scheduled) == 1:
                self.finish(request.request_id, "error", keep_state=False)
                failed.append(request)
                continue
            reach = s.num_computed_tokens + s.num_new_tokens - s.num_draft_tokens
            if request.num_failed_steps >= MAX_FAILED_STEPS:
                reach = request.max_total_tokens + 1  # past any token it will compute
            request.isolate_until = max(request.isolate_until, reach)
            self.running.remove(request)
            self._requeue(request)
        return failed

    # ---- prefix caching ---------------------------------------------------------------------
    def _prefix_hit(self, request: Request) -> PrefixHit | None:
        """Where a request that has computed nothing yet may start (None: from scratch).
        Requests asking for prompt logprobs compute their whole prompt."""
        if request.num_computed_tokens or request.params.prompt_logprobs is not None:
            return None
        tokens = request.cache_key_slice(0, request.num_tokens)
        return self.cache.lookup(tokens, request.num_tokens - 1)  # the last token is computed for its logits

    def _checkpoint_targets(self, request: Request, hit: PrefixHit | None) -> list[tuple[int, str]]:
        """Positions past where the request starts at which its state is saved: the first and
        last conversation boundaries, where it parts from cached content, every `interval`
        blocks, and the end of its prompt."""
        prefix = self.cache.prefix
        if prefix is None:
            return []
        start, end = request.num_computed_tokens, len(request.prompt_token_ids)
        targets: dict[int, str] = {}
        if request.num_computed_tokens < end:
            targets[end] = "prompt_end"
        marked = [b for b in request.boundaries if start < b < end]
        for b in marked[:1] + marked[-1:]:
            targets[b] = "boundary"
        if prefix.interval:
            step = prefix.interval * self.cache.block_size
            for p in range(start - start % step + step, end, step):
                targets.setdefault(p, "interval")
        if hit is not None:
            # A prompt seen whole before is saved one token short: a repeat resumes there
            # (its last token is always computed, for its logits).
            branch = min(hit.branch, end - 1)
            if branch - start >= MIN_BRANCH_TOKENS:
                targets[branch] = "branch"
        return sorted(targets.items())

    def _reached(self, request: Request) -> None:
        """After a step: name the request's filled blocks, save its state where it was due."""
        self.cache.register(request.request_id, request.num_computed_tokens, request.cache_key_slice)
        while request.checkpoint_at and request.checkpoint_at[0][0] <= request.num_computed_tokens:
            position, reason = request.checkpoint_at.pop(0)
            if position == request.num_computed_tokens:
                self.cache.checkpoint(request.request_id, position, request.cache_key_slice, reason)

    def _scheduled(self, request: Request, n: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        real = min(n, request.num_uncomputed)  # drafts come after the request's real tokens
        blocks = self.cache.blocks_of(request.request_id)
        sent = self._blocks_sent.get(request.request_id, 0)
        self._blocks_sent[request.request_id] = len(blocks)
        drafts = request.draft_token_ids[: n - real]
        return ScheduledRequest(
            request_id=request.request_id,
            num_computed_tokens=start,
            token_ids=request.token_slice(start, start + real) + drafts,
            new_block_ids=blocks[sent:],
            state_slot=self.cache.slot_of(request.request_id),
            samples=start + real == request.num_tokens,
            num_draft_tokens=len(drafts),
            prompt_logprob_positions=request.prompt_logprob_positions(start, start + real),
        )

    def _preempt(self, request: Request) -> None:
        # Its state as the last step left it: resuming from there skips the recompute.
        self.cache.checkpoint(request.request_id, request.num_computed_tokens, request.cache_key_slice, "preempt")
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue(request)

    def _requeue(self, request: Request) -> None:
        """Free what a request holds and put it at the front of the queue, to start over."""
        self.cache.release(request.request_id)
        self._blocks_sent.pop(request.request_id, None)  # it restarts on the runner as a new request
        self._requeued_ids.append(request.request_id)
        self._seeded_leaving |= request.params.seed is not None
        request.num_computed_tokens = 0
        request.draft_token_ids = []
        request.status = RequestStatus.WAITING
        self._enqueue(request, front=True)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        """Into the waiting queue: by (priority, arrival) under the priority policy; else at
        the back, or at the front for a request that was running."""
        if self.by_priority:
            _insert_by_priority(self.waiting, request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    # ---- results ----------------------------------------------------------------------------
    def drafting_dormant(self) -> bool:
        """Whether this step's MTP passes may be skipped: the running requests are a batch size
        where a draft row costs a step or more (only probes draft), and none has its own seed
        (those draft on their acceptance alone, and their drafts must not depend on measured
        costs: `propose_drafts`), nor has one that left its blocks since the last step (its owed
        passes run in this step, for a resume from its checkpoint). The running requests, not
        the step's decodes: a step that admits a prompt (no decodes at batch 1) would run its
        MTP pass and the one owed by the request that just left."""
        seeded = self._seeded_left or any(r.params.seed is not None for r in self.running)
        return self.draft_cost.dear(len(self.running)) and not seeded

    def observe_step(self, scheduled: SchedulerOutput, seconds: float, novelty: str = STEADY) -> None:
        """The wall time a step took (its drafting included), for stall-free pacing and the
        speculation guard; `novelty`: whether it ran as a captured shape's first steps do
        (`CapturedDecode.novelty`; `DraftCost.observe` says what the guard makes of it). The
        pacer takes every step: skipping a batch's first decode steps left it no decode cost
        when the next prompts came, and they went in one unbounded chunk (decode_batch32 then
        ran 1.225x faster with one 71 ms mixed step, a stall the pacer exists to bound)."""
        self.pacer.observe(scheduled.num_tokens - scheduled.num_decode_tokens, scheduled.num_decodes, seconds)
        self._step_seconds, self._step_novelty = seconds, novelty

    def update_from_output(self, scheduled: SchedulerOutput, output: ModelRunnerOutput) -> list[RequestUpdate]:
        """Apply one step's results; returns one update per request that produced tokens."""
        by_id = {s.request_id: s for s in scheduled.scheduled}
        for s in scheduled.scheduled:
            request = self.requests.get(s.request_id)
            if request is not None and not request.is_finished:
                request.num_computed_tokens += s.num_new_tokens
        for request_id, scored in output.prompt_logprobs.items():
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            assert scored.first_token == len(request.prompt_logprobs), "prompt tokens scored out of order"
            request.prompt_logprobs += scored.logprobs
            request.prompt_token_ranks += scored.ranks
        updates = []
        for request_id, tokens, logprobs in zip(output.request_ids, output.sampled_token_ids, output.logprobs):
            request = self.requests.get(request_id)
            if request is None or request.is_finished:  # aborted while the step ran
                continue
            s = by_id[request_id]
            # Drafts past the first disagreement were computed on a wrong token: their
            # cache entries get overwritten later, the request recomputes from there.
            request.num_computed_tokens -= s.num_draft_tokens - (len(tokens) - 1)
            if s.num_draft_tokens:
                self.num_drafts += 1
                self.num_draft_tokens += s.num_draft_tokens
                self.num_accepted_tokens += len(tokens) - 1
                record_verify(request, s.num_draft_tokens, len(tokens) - 1)
            request.draft_token_ids = []
            updates.append(self._append(request, tokens, logprobs))
        if self.cache.prefix is not None:
            for s in scheduled.scheduled:
                request = self.requests.get(s.request_id)
                if request is not None and not request.is_finished:
                    self._reached(request)
        if self._step_seconds and scheduled.num_tokens == scheduled.num_decode_tokens:
            self.draft_cost.observe(len(scheduled.scheduled), sum(s.num_draft_tokens for s in scheduled.scheduled),
                                    self._step_seconds, self._step_novelty)  # fmt: skip
        self._step_seconds = None
        return updates

    def propose_drafts(self, proposer, max_drafts: int) -> None:
        """Draft tokens from `proposer` (`propose([(request, k)]) -> {request_id: tokens}`) for
        every running request whose next step is a decode: at most `max_drafts`, and at most
        as many as it may still generate beyond the one token the step yields anyway; none
        when a draft row costs more than a draft returns at this batch size (spec_guard.py),
        or when the step will carry prefill.
        A request with its own seed drafts on its acceptance alone (at KEEP_FLOOR): measured
        costs vary run to run, and where drafts fall decides which random draws it makes."""
        decoding = sum(1 for r in self.running if r.num_uncomputed == 1)
        # A step that carries prefill is a throughput step: draft rows would take its token
        # budget, and their cost there is not measured.
        prefill_next = len(self.running) > decoding or (self.waiting and len(self.running) < self.config.max_num_seqs)
        budget = self.draft_cost.budget(decoding) if decoding and not prefill_next else None
        wanted: list[tuple[Request, int]] = []
        for request in self.running:
            # A constrained request is not drafted: its verify rows would each need the mask
            # of the draft prefix before them.
            if request.num_uncomputed != 1 or request.params.structured_outputs is not None:
                continue
            if request.params.seed is not None:
                floor, most = KEEP_FLOOR, max_drafts
            elif budget is not None:
                floor, most = budget
            else:
                continue
            room = request.max_total_tokens - request.num_tokens
            if request.params.max_tokens is not None:
                room = min(room, request.params.max_tokens - len(request.output_token_ids))
            depth = draft_depth(request, min(max_drafts, most), floor)
            if depth == 0:  # drafting is off for this request: probe again after a while
                request.decodes_without_drafts += 1
                if request.decodes_without_drafts < PROBE_INTERVAL:
                    continue
                request.decodes_without_drafts, depth = 0, 1
            k = min(depth, room - 1)
            if k > 0:
                wanted.append((request, k))
        if wanted:
            drafts = proposer.propose(wanted)
            for request, k in wanted:
                request.draft_token_ids = drafts.get(request.request_id, [])[:k]

    def _append(self, request: Request, tokens: list[int], logprobs: list[dict[int, float]] | None) -> RequestUpdate:
        accepted = []
        for i, token in enumerate(tokens):
            request.output_token_ids.append(token)
            if logprobs is not None:
                request.output_logprobs.append(logprobs[i])
            accepted.append(token)
            if stop := token_stop(request, token):
                self.finish(request.request_id, *stop)
                break
        kept_logprobs = None if logprobs is None else logprobs[: len(accepted)]
        return RequestUpdate(request, accepted, kept_logprobs)

    # ---- retiring ---------------------------------------------------------------------------
    def finish(self, request_id: str, reason: str, stop_reason: int | str | None = None, keep_state: bool = True) -> Request | None:
        """Finish (or abort) a request and free what it holds; None if it is unknown or done.
        `keep_state=False`: its cache state is not to be trusted, so no checkpoint is taken."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        if keep_state and request.status is RequestStatus.RUNNING:  # its state, for a conversation that goes on
            self.cache.checkpoint(request_id, request.num_computed_tokens, request.cache_key_slice, "finish")
        request.finish(reason, stop_reason)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.cache.release(request_id)
        self._blocks_sent.pop(request_id, None)
        self._finished_ids.append(request_id)
        self._seeded_leaving |= request.params.seed is not None
        return request

    def forget(self, request_id: str) -> None:
        """Drop a finished request from the table (once its final output has been taken)."""
        request = self.requests.get(request_id)
        if request is not None and request.is_finished:
            del self.requests[request_id]
