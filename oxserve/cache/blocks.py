"""Paged cache blocks with reference counts, and the content hashes that let prompts share them.

A full block (every one of its `block_size` positions computed) is named by a hash of its
tokens and of the hash of the blocks before it, so equal hashes mean equal prefixes:

    prompt:  t0 .. t63 | t64 .. t127 | t128 .. t150        block_size 64
    hashes:  h1 = H(root, t0..63)   h2 = H(h1, t64..127)   (partial: not hashed)

A hashed block stays readable after its last holder lets go: it moves to an LRU list of free
blocks with content and is reused by any prompt that starts with the same tokens, until an
allocation needs it (blocks with no content go first, then the least recently used).
Hashes are 128-bit BLAKE2b: a prompt cannot be crafted to collide with another's blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence

ROOT = b""  # the hash of the empty prefix


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def prefix_hashes(tokens: Sequence[int], block_size: int, start: int = 0, parent: bytes = ROOT) -> list[bytes]:
    """Hashes of the full blocks of `tokens` from block `start` on, chained on `parent`."""
    out = []
    for first in range(start * block_size, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[first : first + block_size])
        out.append(parent)
    return out


class BlockPool:
    """Block ids with reference counts. A block is free at count 0; a free block with a hash
    keeps its content (and its place in `block_of`) until it is allocated again."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"need at least one cache block, got {size}")
        self.size = size
        self.refs = [0] * size
        self._empty: deque[int] = deque(range(size))  # free, no content worth keeping
        self._cached: OrderedDict[int, None] = OrderedDict()  # free with content, least recently used first
        self.block_of: dict[bytes, int] = {}  # content hash -> the block that holds it
        self.hash_of: dict[int, bytes] = {}
        self.tokens_of: dict[int, tuple[int, ...]] = {}  # a hashed block's tokens (to find where prompts part)
        self.children: dict[bytes, set[int]] = {}  # parent hash -> hashed blocks that follow it
        self._parent_of: dict[int, bytes] = {}
        self.evictions = 0  # hashed blocks whose content was dropped to make room

    @property
    def num_free(self) -> int:
        return len(self._empty) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks that hold a hashed prefix (in use or free)."""
        return len(self.hash_of)

    def is_free_cached(self, block: int) -> bool:
        return block in self._cached

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} cache blocks with {self.num_free} free")
        out = []
        for _ in range(n):
            if self._empty:
                block = self._empty.popleft()
            else:
                block, _ = self._cached.popitem(last=False)
                self._forget(block)
                self.evictions += 1
            self.refs[block] = 1
            out.append(block)
        return out

    def acquire(self, block: int) -> None:
        """One more holder of a block (a prompt reusing it, or a checkpoint pinning it)."""
        if self.refs[block] == 0:
            if block not in self._cached:
                raise RuntimeError(f"block {block} is free and holds no content")
            del self._cached[block]
        self.refs[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one holder of each block. Released last-first, so that a request's tail is
        the least recently used and goes before the blocks its prefix shares with others."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] < 0:
                raise RuntimeError(f"block {block} released more often than held")
            if self.refs[block] == 0:
                if block in self.hash_of:
                    self._cached[block] = None
                else:
                    self._empty.append(block)

    def drop_cached(self) -> None:
        """Forget the content of every free block."""
        while self._cached:
            block, _ = self._cached.popitem(last=False)
            self._forget(block)
            self._empty.append(block)

    def register(self, block: int, parent: bytes, tokens: Sequence[int]) -> bytes:
        """Name a block that now holds `tokens` after the prefix `parent`; its hash. If another
        block already holds that content, this one stays unnamed (and is freed as plain)."""
        h = block_hash(parent, tokens)
        if h not in self.block_of and block not in self.hash_of:
            self.block_of[h] = block
            self.hash_of[block] = h
            self.tokens_of[block] = tuple(tokens)
            self.children.setdefault(parent, set()).add(block)
            self._parent_of[block] = parent
        return h

    def _forget(self, block: int) -> None:
        h = self.hash_of.pop(block)
        del self.block_of[h]
        del self.tokens_of[block]
        parent = self._parent_of.pop(block)
        siblings = self.children[parent]
        siblings.discard(block)
        if not siblings:
            del self.children[parent]
