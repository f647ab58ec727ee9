"""Cache bookkeeping: which blocks and state slots each request holds. No tensors here.

    request: block_ids = [7, 2, 9]   (block_size 4)      state_slot = 3
    positions 0..3 -> block 7, 4..7 -> block 2, 8..11 -> block 9

A request holds ceil(tokens / block_size) blocks for its paged MLA/indexer data and exactly
one slot for its fixed-size KDA state while it is running. Both go back to the pools when it
finishes, aborts or is preempted.
"""

from __future__ import annotations

from collections import deque


class IdPool:
    """A free list of integer ids (cache blocks, or KDA state slots)."""

    def __init__(self, size: int, what: str):
        if size < 1:
            raise ValueError(f"need at least one {what}, got {size}")
        self.size = size
        self.what = what
        self._free = deque(range(size))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} {self.what}s with {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, ids: list[int]) -> None:
        self._free.extend(ids)


class CacheManager:
    """Grows and releases the block lists and slots of requests."""

    def __init__(self, num_blocks: int, block_size: int, num_slots: int):
        self.block_size = block_size
        self.blocks = IdPool(num_blocks, "cache block")
        self.slots = IdPool(num_slots, "state slot")
        self._held: dict[str, list[int]] = {}
        self._slot_of: dict[str, int] = {}

    def blocks_of(self, request_id: str) -> list[int]:
        return self._held.get(request_id, [])

    def slot_of(self, request_id: str) -> int:
        return self._slot_of[request_id]

    def extra_blocks_needed(self, request_id: str, total_tokens: int) -> int:
        need = -(-total_tokens // self.block_size)
        return max(0, need - len(self.blocks_of(request_id)))

    def can_grow(self, request_id: str, total_tokens: int) -> bool:
        slot_ok = request_id in self._slot_of or self.slots.num_free > 0
        return slot_ok and self.extra_blocks_needed(request_id, total_tokens) <= self.blocks.num_free

    def grow(self, request_id: str, total_tokens: int) -> None:
        """Make sure the request holds a slot and blocks for `total_tokens` tokens."""
        if not self.can_grow(request_id, total_tokens):
            raise RuntimeError(f"cannot grow {request_id} to {total_tokens} tokens")
        if request_id not in self._slot_of:
            (self._slot_of[request_id],) = self.slots.allocate(1)
        extra = self.extra_blocks_needed(request_id, total_tokens)
        self._held.setdefault(request_id, []).extend(self.blocks.allocate(extra))

    def release(self, request_id: str) -> None:
        self.blocks.free(self._held.pop(request_id, []))
        if (slot := self._slot_of.pop(request_id, None)) is not None:
            self.slots.free([slot])

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - self.blocks.num_free / self.blocks.size

    @property
    def num_holders(self) -> int:
        return len(self._slot_of)
