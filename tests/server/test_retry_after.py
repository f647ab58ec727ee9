"""Retry-After from the recent finish rate and the queue (a fake clock: no waiting)."""

from __future__ import annotations

from oxserve.server.retry_after import MAX_S, MIN_S, WINDOW_S, FinishRate


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_wait_is_the_queue_at_the_recent_rate():
    clock = Clock()
    rate = FinishRate(clock)
    assert rate.retry_after(50) == MIN_S  # nothing finished yet: no rate to go by
    for _ in range(10):  # 10 finishes over 20 s: 0.5 requests/s
        clock.now += 2.0
        rate.record()
    clock.now += 2.0  # 10 finishes over the last 20 s
    assert rate.retry_after(0) == 2  # the new request alone: 1 / 0.5 per s
    assert rate.retry_after(19) == 40  # 20 requests ahead of it at 0.5/s
    assert rate.retry_after(10**6) == MAX_S


def test_old_finishes_are_forgotten():
    clock = Clock()
    rate = FinishRate(clock)
    for _ in range(5):
        rate.record()
        clock.now += 1.0
    assert rate.retry_after(100) > MIN_S
    clock.now += WINDOW_S + 1
    assert rate.retry_after(100) == MIN_S  # the rate is stale: back to the floor
