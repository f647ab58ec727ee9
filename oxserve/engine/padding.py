"""Padding rows: a decode batch filled up to a captured batch size, so that a few recordings
serve the batch sizes a ramp or a tail passes through, as vLLM pads a batch to its CUDA-graph
sizes.

Without them a captured step served one batch size only. A batch size met for a step or two
(the tail of a wave of requests that finish one after another) ran eagerly, then recorded,
then built its replay plan: 5, 12 and 3 ms at batch 8 on a Xeon, against a 2 ms replay.
Padding rows are not free on a CPU, though: 17 requests padded to 24 took 12-23% longer a
step than 17 replayed as they are (`python docs/bench/decode_step_split.py 17
[--compile-sizes 1,2,4,8,16,17,24,32]`, before this rule). So a batch size that has taken half of the last 64 decode
steps (a steady load) runs unpadded, and is recorded as it is.

A recording is not free either: the step that records costs about two eager steps, and the
first replay builds its plan (together 10-19 ms on a Xeon, against a 1.5-5 ms replay). A tail
passes through each size for a step or two, so where a larger size is already recorded (at
the same table shape: `model.batch.table_shape`) a batch runs padded to it, and its own size
is recorded only once the padding rows it was given have cost, by estimate, as much as a
recording costs (rent, then buy: at most about twice the better choice's cost). The estimate
errs towards recording: a padding row is charged its share of the larger replay's time (a
replay's fixed cost is shared), a recording costs the mean time of the steps that recorded
(its plan's build left out), and a size's rent carries over when the table shape changes.

A padding row decodes one token at position 1 of a request that exists for this alone: its
own KDA state slot and cache block (two where a block holds one token: so that padding rows
never change a step's table shape), one of each past what the scheduler hands out. Padding
rows write there and read back what earlier ones left (the slot is never reset, and the
padding rows of one step race on it): values that nothing else reads. Every op of a decode
step computes each row on its own, so the requests' rows are computed as they would be
without them (tested bit for bit, with up to seven padding rows a step).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import replace

from oxserve.cache.spec import CacheLayout
from oxserve.model.batch import BatchRequest

PADDING_TOKEN = 0
STEADY_WINDOW = 64  # decode steps: a batch size in half of them runs unpadded


class DecodePadding:
    def __init__(self, sizes: tuple[int, ...], slot: int, block: int, block_size: int):
        self.sizes = sizes  # the captured batch sizes, ascending
        self.slot, self.block = slot, block  # the padding rows' KDA state slot and cache block
        self.row_blocks = [block] * -(-2 // block_size)  # a padding row's table: positions 0 and 1
        self._recent: deque[int] = deque(maxlen=STEADY_WINDOW)  # the last decode steps' batch sizes
        self._counts: Counter[int] = Counter()
        self._rent: Counter[int] = Counter()  # per size not recorded: the seconds its padding to larger ones cost

    @staticmethod
    def past(layout: CacheLayout, sizes: tuple[int, ...]) -> tuple[CacheLayout, DecodePadding]:
        """`layout` with one more block and slot (the padding rows'), and the padding."""
        padded = replace(layout, num_blocks=layout.num_blocks + 1, num_slots=layout.num_slots + 1)
        return padded, DecodePadding(sizes, slot=layout.num_slots, block=layout.num_blocks, block_size=layout.block_size)

    def size_for(self, num_requests: int, recorded: dict[int, float] | None = None, recording_s: float = 0.0) -> int:
        """The batch size a decode step of `num_requests` runs as: the smallest captured size
        that holds it, or itself when the load is steady there (or no size holds it); but the
        smallest `recorded` size that holds it ({size: seconds a replay takes}) while
        recording that size would cost more (`recording_s`) than its padding has so far."""
        if len(self._recent) == STEADY_WINDOW:
            self._counts[self._recent[0]] -= 1
        self._recent.append(num_requests)
        self._counts[num_requests] += 1
        if 2 * self._counts[num_requests] >= STEADY_WINDOW:
            size = num_requests
        else:
            size = next((size for size in self.sizes if size >= num_requests), num_requests)
        larger = min((s for s in recorded or () if s >= num_requests), default=size)
        if larger <= size:
            return larger
        self._rent[size] += recorded[larger] * (larger - size) / larger
        if self._rent[size] < recording_s:
            return larger
        del self._rent[size]
        return size

    def rows(self, count: int) -> list[BatchRequest]:
        return [BatchRequest(1, 1, self.row_blocks, self.slot, True)] * count
