"""When speculation pays: how many drafts each request makes at this batch size.

A draft is worth its verify row when its chance of being kept is at least what the row
costs, in units of one request's plain decode step. Both sides are measured:

- Per request, a running estimate `alpha` of the chance that a draft token is kept. A verify
  that kept a of d drafts saw a hits and, when a < d, one miss; older verifies fade by DECAY.
  The j-th draft survives only if those before it did, with chance about alpha^j. A new
  request starts at alpha = 0.75, worth four verifies (`Request.draft_hits`).
- Per batch-size bucket (powers of two), `DraftCost` measures what a draft row costs: from
  decode-only steps, the plain step time, and for steps with drafts the extra time per draft
  row over the plain step, as a share of a request's part of that step. At batch 1 on these
  CPUs a row costs about a quarter of a step (more rows touch more experts); at batch 64 a
  step is compute-bound and a row costs about what a plain row does, so drafting stops.

A request drafts the depths j with alpha^j >= that cost (never under MIN_FLOOR), at most k.
One below the cost at depth 1 drafts nothing, and probes with one draft after PROBE_INTERVAL
plain decodes. Both times stay measured: a bucket's first FIRST_PLAIN steps are plain (the
step the cost is relative to), then its first measure of a row is one draft per request at
KEEP_FLOOR (the cheapest probe: where a row costs a whole step, as on AVX2 CPUs at batch 1,
three drafts a request would cost three); where drafting pays, one step in EXPLORE is plain;
where it does not, a probe of one draft per request comes after EXPLORE_DEAR steps, and each
probe that finds rows still dear doubles the wait, up to EXPLORE_DEAR_MAX: no acceptance
pays for a row that costs a step, so the probes only watch for the cost coming down.
A captured shape's first steps (eager where it is met first, then recording, then a first
replay) cost several replays each: only where shapes never recur is that what drafting
costs (`DraftCost.observe`).
"""

from __future__ import annotations

import math

from oxserve.engine.interface import NEW_SHAPE, SETTLING, STEADY
from oxserve.engine.request import Request

DECAY = 0.9
KEEP_FLOOR = 0.3
MIN_FLOOR = 0.1
PROBE_INTERVAL = 16
EXPLORE = 16
EXPLORE_DEAR = 64
EXPLORE_DEAR_MAX = 1024
MAX_DEPTH = 1 << 30  # no cap: k bounds it
FIRST_PLAIN = 3  # a bucket's first steps: the plain step, measured past a slow first one
WARMING_PROBES = 6  # probes a bucket's first row measure may skip as warming (see `observe`)
SMOOTHING = 0.1  # weight of the newest step in a bucket's measurements


def draft_depth(request: Request, k: int, floor: float) -> int:
    """How many drafts the request's acceptance warrants when a row costs `floor` (0: none)."""
    alpha = request.draft_hits / request.draft_trials
    if alpha < floor:
        return 0
    if alpha >= 1.0:
        return k
    return min(k, max(1, int(math.log(floor) / math.log(alpha))))


def record_verify(request: Request, drafted: int, accepted: int) -> None:
    request.draft_hits = DECAY * request.draft_hits + accepted
    request.draft_trials = DECAY * request.draft_trials + accepted + (1 if accepted < drafted else 0)


class DraftCost:
    def __init__(self) -> None:
        self.plain_s: dict[int, float] = {}  # bucket -> decode-only step without drafts, seconds
        self.row_cost: dict[int, float] = {}  # bucket -> a draft row, in request-steps
        self._steps: dict[int, int] = {}  # decisions made per bucket
        self._probe_wait: dict[int, int] = {}  # bucket -> steps between probes where rows are dear
        self._since_probe: dict[int, int] = {}
        self._warming_probes: dict[int, int] = {}  # bucket -> probes skipped before its first row measure

    def budget(self, decodes: int) -> tuple[float, int] | None:
        """For the next step, with `decodes` decoding requests: the chance of being kept a
        draft needs, and the most drafts a request may make; None: no drafts in that step."""
        bucket = decodes.bit_length()
        n = self._steps.get(bucket, 0)
        self._steps[bucket] = n + 1
        if n < FIRST_PLAIN or bucket not in self.plain_s:  # a row's cost is measured against the plain step
            return None
        cost = self.row_cost.get(bucket)
        if cost is None:  # not measured yet: the cheapest measure
            return KEEP_FLOOR, 1
        if cost < 1.0:  # drafting pays: one plain step in EXPLORE keeps the plain time current
            self._probe_wait.pop(bucket, None)
            self._since_probe.pop(bucket, None)
            return None if n % EXPLORE == 0 else (max(MIN_FLOOR, cost), MAX_DEPTH)
        # It does not: one draft per request now and then, to notice if it comes to
        since, wait = self._since_probe.get(bucket, 0) + 1, self._probe_wait.get(bucket, EXPLORE_DEAR)
        if since < wait:
            self._since_probe[bucket] = since
            return None
        self._since_probe[bucket], self._probe_wait[bucket] = 0, min(2 * wait, EXPLORE_DEAR_MAX)
        return KEEP_FLOOR, 1

    def dear(self, decodes: int) -> bool:
        """Whether a draft row is measured to cost a whole step or more at this batch size: then
        only probes draft."""
        return self.row_cost.get(decodes.bit_length(), 0.0) >= 1.0

    def observe(self, decodes: int, draft_rows: int, seconds: float, novelty: str = STEADY) -> None:
        """A decode-only step: its decoding requests, its draft rows, its wall time (the
        drafting included), and its `CapturedDecode.novelty`. A recording or a first replay
        (SETTLING) is a shape's one-time cost: never a measure. A shape met first (NEW_SHAPE)
        is no measure of the plain step (its shapes recur), nor of a row before a replayed step
        has measured one: a batch size's first probes are such steps by nature, and charging
        them would stop drafting for thousands of steps. After that it counts: where verify
        shapes keep changing (each request's run length, and which requests draft, are in the
        shape), eager steps are what drafting costs; so do a bucket's probes past
        WARMING_PROBES that found no replay."""
        if decodes <= 0 or seconds <= 0 or novelty == SETTLING:
            return
        bucket = decodes.bit_length()
        if novelty == NEW_SHAPE and draft_rows == 0:
            return
        if novelty == NEW_SHAPE and bucket not in self.row_cost:
            skipped = self._warming_probes.get(bucket, 0)
            if skipped < WARMING_PROBES:
                self._warming_probes[bucket] = skipped + 1
                return
        if draft_rows == 0:  # few samples, some slowed by what else ran: follow the faster ones
            old = self.plain_s.get(bucket)
            self.plain_s[bucket] = seconds if old is None or seconds < old else _mix(old, seconds)
        elif bucket in self.plain_s:
            plain = self.plain_s[bucket]
            cost = decodes * (seconds - plain) / (draft_rows * plain)
            self.row_cost[bucket] = _mix(self.row_cost.get(bucket), min(max(cost, 0.0), 2.0))


def _mix(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
