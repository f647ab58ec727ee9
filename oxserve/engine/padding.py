"""Padding rows: a decode batch filled up to a captured batch size, so that a few recordings
serve every batch size, as vLLM pads a batch to its CUDA-graph sizes.

Without them a captured step served one batch size only. A batch size met for a step or two
(the tail of a wave of requests that finish one after another) ran eagerly, then recorded,
then built its replay plan: 5, 12 and 3 ms at batch 8 on a Xeon, against a 2 ms replay.

A padding row decodes one token at position 1 of a request that exists for this alone: its
own KDA state slot and cache block, one of each past what the scheduler hands out. Every
padding row writes the entries of position 1 there, and reads them with those of position 0,
which nothing writes (zeros): the rows compute finite values that nothing reads, and each op
of a decode step computes every other row as it would without them (tested bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from oxserve.cache.spec import CacheLayout
from oxserve.model.batch import BatchRequest

PADDING_TOKEN = 0


@dataclass(frozen=True)
class DecodePadding:
    sizes: tuple[int, ...]  # the captured batch sizes, ascending
    slot: int  # the padding rows' KDA state slot
    block: int  # and cache block

    @staticmethod
    def past(layout: CacheLayout, sizes: tuple[int, ...]) -> tuple[CacheLayout, DecodePadding]:
        """`layout` with one more block and slot, and the padding whose they are."""
        padded = replace(layout, num_blocks=layout.num_blocks + 1, num_slots=layout.num_slots + 1)
        return padded, DecodePadding(sizes, slot=layout.num_slots, block=layout.num_blocks)

    def size_for(self, num_requests: int) -> int:
        """The captured size a decode batch runs as (itself when no size holds it: eagerly)."""
        return next((size for size in self.sizes if size >= num_requests), num_requests)

    def rows(self, count: int) -> list[BatchRequest]:
        return [BatchRequest(1, 1, [self.block], self.slot, True)] * count
