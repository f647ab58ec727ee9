"""Retry-After from the queue: how long the requests waiting now should take to start, at
the rate requests have been finishing lately (a fixed 1 s told a client to come back while
minutes of work were still queued)."""

from __future__ import annotations

import math
import time
from collections import deque

WINDOW_S = 60.0  # finishes older than this no longer count towards the rate
MIN_S, MAX_S = 1, 600  # whole seconds, as the header takes them


class FinishRate:
    """The recent rate of finished requests, and the wait it implies for a queue."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._finished: deque[float] = deque()

    def record(self) -> None:
        self._finished.append(self.clock())
        self._forget()

    def retry_after(self, waiting: int) -> int:
        """Seconds until `waiting` queued requests (and the new one) may have started; MIN_S
        while nothing has finished lately (no rate to go by)."""
        self._forget()
        if len(self._finished) < 2:
            return MIN_S
        span = max(self.clock() - self._finished[0], 1e-3)
        rate = len(self._finished) / span  # requests per second
        return max(MIN_S, min(MAX_S, math.ceil((waiting + 1) / rate)))

    def _forget(self) -> None:
        horizon = self.clock() - WINDOW_S
        while self._finished and self._finished[0] < horizon:
            self._finished.popleft()
