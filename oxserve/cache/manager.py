"""Cache bookkeeping: which blocks and state slots each request holds. No tensors here.

    request: block_ids = [7, 2, 9]   (block_size 4)      state_slot = 3
    positions 0..3 -> block 7, 4..7 -> block 2, 8..11 -> block 9

A request holds ceil(tokens / block_size) blocks for its paged MLA/indexer data and exactly
one slot for its fixed-size KDA state while it is running. Both go back to the pools when it
finishes, aborts or is preempted.

With prefix caching (`PrefixCaching`), a request's full blocks are named by their content
(`oxserve.cache.blocks`) and may be shared, read-only, with any request whose tokens start
the same way; KDA layers summarise a prefix in a state that exists only where it was saved,
so a request resumes at the longest prefix that has both its blocks and a checkpoint at
exactly that position (`oxserve.cache.checkpoints`):

    cached:   [b7 full][b2 full][b9: 23 of 64 tokens]    checkpoint at 151, pins b9
    new:      same 151 tokens + more  ->  shares b7, b2; b9 is copied into a fresh block;
              its state slot is restored from the checkpoint; it computes from 151 on

The tensors follow from `CacheOps` (saves, restores, block copies), which the runner applies
at the start of the next step, saves first: a checkpoint reads the state of a slot as the
previous step left it, even if the slot has been handed to another request since.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from oxserve.cache.blocks import ROOT, BlockPool, block_hash
from oxserve.cache.checkpoints import Checkpoint, CheckpointIndex

TokensOf = Callable[[int, int], list[int]]  # (start, end) -> a request's tokens at those positions
# A branch point (where a prompt parts from cached content) is saved as a checkpoint only if
# the request would compute at least this many tokens of shared prefix: saving costs a cut
# in its prefill, and two random prompts share a token or two by chance.
MIN_BRANCH_TOKENS = 16
# Why a checkpoint is taken. marconi admits all but prompt ends (a prompt alone is reused only
# when another starts with it, which the branch point catches); lru admits everything.
REASONS = ("finish", "preempt", "boundary", "branch", "interval", "prompt_end")


class IdPool:
    """A free list of integer ids (KDA state slots)."""

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


@dataclass(frozen=True)
class PrefixCaching:
    """How prefix caching runs (None on the manager: off)."""

    num_checkpoints: int  # rows of the checkpoint store
    state_bytes: int  # one checkpoint's KDA state (0: the model has no KDA layers)
    block_bytes: int  # one paged block, over every layer
    prefill_cost: Callable[[int], float]  # work to prefill a prefix of n tokens
    policy: str = "marconi"
    alpha: float = 1.0
    interval: int = 0  # also checkpoint every `interval` blocks of a prompt (0: no)

    @property
    def needs_state(self) -> bool:
        """A hit must land on a checkpoint (else any full-block boundary will do)."""
        return self.state_bytes > 0

    def admits(self, reason: str) -> bool:
        return self.policy == "lru" or reason != "prompt_end"


@dataclass(frozen=True)
class PrefixHit:
    """Where a request can resume: `position` tokens need not be computed."""

    position: int
    blocks: list[int]  # the shared full blocks, in order
    hashes: list[bytes]  # their content hashes
    checkpoint: Checkpoint | None  # the state at `position` (None: block-aligned, no KDA state)
    branch: int  # where the tokens part from everything cached (a checkpoint worth taking)


@dataclass
class CacheOps:
    """Tensor work a step does before its forward, in this order."""

    saves: list[tuple[int, int]] = field(default_factory=list)  # (state slot, checkpoint row)
    restores: list[tuple[int, int]] = field(default_factory=list)  # (checkpoint row, state slot)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source block, destination block)

    def __bool__(self) -> bool:
        return bool(self.saves or self.restores or self.copies)


@dataclass
class PrefixStats:
    queries: int = 0  # tokens looked up (computable tokens of admitted requests)
    hits: int = 0  # ... that were found and not computed
    requests: int = 0  # admitted requests that looked
    hit_requests: int = 0  # ... and found something


class CacheManager:
    """Grows and releases the block lists and slots of requests."""

    def __init__(self, num_blocks: int, block_size: int, num_slots: int, prefix: PrefixCaching | None = None):
        self.block_size = block_size
        self.blocks = BlockPool(num_blocks)
        self.slots = IdPool(num_slots, "state slot")
        self.prefix = prefix
        self.checkpoints = CheckpointIndex(prefix.num_checkpoints, prefix.policy, prefix.alpha) if prefix else None
        self.stats = PrefixStats()
        self._held: dict[str, list[int]] = {}
        self._slot_of: dict[str, int] = {}
        self._hashes: dict[str, list[bytes]] = {}  # content hashes of a request's full blocks so far
        self._ops = CacheOps()

    def blocks_of(self, request_id: str) -> list[int]:
        return self._held.get(request_id, [])

    def slot_of(self, request_id: str) -> int:
        return self._slot_of[request_id]

    def extra_blocks_needed(self, request_id: str, total_tokens: int) -> int:
        need = -(-total_tokens // self.block_size)
        return max(0, need - len(self.blocks_of(request_id)))

    def holds(self, request_id: str, total_tokens: int) -> bool:
        """Whether the request holds a slot and blocks for `total_tokens` tokens already (most
        decode steps: a block lasts block_size of them)."""
        held = self._held.get(request_id)
        return held is not None and len(held) * self.block_size >= total_tokens and request_id in self._slot_of

    def can_grow(self, request_id: str, total_tokens: int) -> bool:
        if self.holds(request_id, total_tokens):
            return True
        slot_ok = request_id in self._slot_of or self.slots.num_free > 0
        return slot_ok and self._available(self.extra_blocks_needed(request_id, total_tokens))

    def grow(self, request_id: str, total_tokens: int) -> None:
        """Make sure the request holds a slot and blocks for `total_tokens` tokens."""
        if self.holds(request_id, total_tokens):
            return
        if not self.can_grow(request_id, total_tokens):
            raise RuntimeError(f"cannot grow {request_id} to {total_tokens} tokens")
        if request_id not in self._slot_of:
            (self._slot_of[request_id],) = self.slots.allocate(1)
        extra = self.extra_blocks_needed(request_id, total_tokens)
        self._reclaim(extra)
        self._held.setdefault(request_id, []).extend(self.blocks.allocate(extra))

    # Checkpoints pin partial blocks, but they are a cache, not holders: under block pressure
    # the checkpoints pinning blocks that nothing else holds are evicted to free them.
    # A resume's shared blocks are neither free nor reclaimable once it holds them: `reserved`
    # counts the free ones it takes, `shared` excludes the ones checkpoints alone pin.
    def _available(self, n: int, reserved: int = 0, keep: Checkpoint | None = None, shared: Sequence[int] = ()) -> bool:
        free = self.blocks.num_free - reserved
        return n <= free or (self.checkpoints is not None and n <= free + len(self._reclaimable(keep).keys() - set(shared)))

    def _reclaimable(self, keep: Checkpoint | None = None) -> dict[int, list[Checkpoint]]:
        """Blocks held only by checkpoints not in use this step (nor `keep`) -> those checkpoints."""
        pins: dict[int, list[Checkpoint]] = {}
        for c in self.checkpoints.live.values():
            if c.block is not None:
                pins.setdefault(c.block, []).append(c)
        step = self.checkpoints.step
        return {b: cs for b, cs in pins.items()
                if self.blocks.refs[b] == len(cs) and all(c.last_used < step and c is not keep for c in cs)}  # fmt: skip

    def _reclaim(self, n: int) -> None:
        while self.blocks.num_free < n:
            pinned = self._reclaimable()
            victim = self.checkpoints.evict([c for cs in pinned.values() for c in cs])
            self.blocks.release([victim.block])

    def release(self, request_id: str) -> None:
        self.blocks.release(self._held.pop(request_id, []))
        self._hashes.pop(request_id, None)
        if (slot := self._slot_of.pop(request_id, None)) is not None:
            self.slots.free([slot])

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (blocks that only checkpoints pin give way
        under pressure, as free blocks with cached content do)."""
        cached_only = 0
        if self.checkpoints is not None:
            pins: dict[int, int] = {}
            for c in self.checkpoints.live.values():
                if c.block is not None:
                    pins[c.block] = pins.get(c.block, 0) + 1
            cached_only = sum(1 for b, n in pins.items() if self.blocks.refs[b] == n)
        return 1.0 - (self.blocks.num_free + cached_only) / self.blocks.size

    @property
    def num_holders(self) -> int:
        return len(self._slot_of)

    # ---- prefix caching -----------------------------------------------------------------------
    def next_step(self) -> CacheOps:
        """The cache operations gathered since the last call; a new step begins."""
        ops, self._ops = self._ops, CacheOps()
        if self.checkpoints is not None:
            self.checkpoints.step += 1
        return ops

    def reset_prefix_cache(self) -> bool:
        """Drop every checkpoint and cached block, as vLLM's reset_prefix_cache; only when no
        request holds cache (False otherwise, and nothing changes)."""
        if self.checkpoints is None or self._held:
            return False
        for c in list(self.checkpoints.live.values()):
            self.checkpoints.remove(c)
            if c.block is not None:
                self.blocks.release([c.block])
        self.blocks.drop_cached()
        self._ops.saves.clear()  # saves into rows that no checkpoint owns any more
        return True

    def lookup(self, tokens: Sequence[int], limit: int) -> PrefixHit | None:
        """The longest cached prefix of `tokens` of at most `limit` tokens (None: nothing)."""
        if self.prefix is None:
            return None
        bs = self.block_size
        parent, blocks, hashes = ROOT, [], []
        best: tuple[int, Checkpoint | None, int] = (0, None, 0)  # (position, checkpoint, shared blocks)
        while True:
            start = len(blocks) * bs
            upcoming = tokens[start : start + bs - 1]
            if (c := self.checkpoints.find(parent, upcoming, limit - start)) is not None and c.position > best[0]:
                best = (c.position, c, len(blocks))
            elif not self.prefix.needs_state and start > best[0] and start <= limit:
                best = (start, None, len(blocks))
            if start + bs > len(tokens):
                break
            h = block_hash(parent, tokens[start : start + bs])
            if (block := self.blocks.block_of.get(h)) is None:
                break
            blocks.append(block)
            hashes.append(h)
            parent = h
        branch = len(blocks) * bs + self._common_after(parent, tokens[len(blocks) * bs :])
        position, checkpoint, shared = best
        if position == 0 and branch == 0:
            return None
        return PrefixHit(position, blocks[:shared], hashes[:shared], checkpoint, min(branch, len(tokens)))

    def _common_after(self, parent: bytes, upcoming: Sequence[int]) -> int:
        """The most leading tokens `upcoming` shares with a cached block or checkpoint after `parent`."""
        best = 0
        known = [self.blocks.tokens_of[b] for b in self.blocks.children.get(parent, ())] + self.checkpoints.tails_after(parent)
        for tokens in known:
            n = 0
            for a, b in zip(tokens, upcoming):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    def can_resume(self, hit: PrefixHit, total_tokens: int) -> bool:
        """Room for a new request resuming at `hit` and holding `total_tokens` tokens."""
        reused_free = sum(self.blocks.is_free_cached(b) for b in hit.blocks)
        fresh = -(-total_tokens // self.block_size) - len(hit.blocks)
        return self.slots.num_free > 0 and self._available(fresh, reserved=reused_free, keep=hit.checkpoint, shared=hit.blocks)

    def resume(self, request_id: str, hit: PrefixHit, total_tokens: int) -> None:
        """Start a request at `hit`: share its blocks, copy the partial one, restore its state."""
        if (c := hit.checkpoint) is not None:
            self.checkpoints.use(c)  # first: in use this step, it is not evicted to make room below
        for block in hit.blocks:
            self.blocks.acquire(block)
        self._held[request_id] = list(hit.blocks)
        self._hashes[request_id] = list(hit.hashes)
        self.grow(request_id, total_tokens)
        if c is not None:
            self._ops.restores.append((c.id, self._slot_of[request_id]))
            if c.block is not None:
                self._ops.copies.append((c.block, self._held[request_id][len(hit.blocks)]))

    def count_lookup(self, computable: int, hit_tokens: int) -> None:
        self.stats.requests += 1
        self.stats.queries += computable
        self.stats.hits += hit_tokens
        self.stats.hit_requests += hit_tokens > 0

    def register(self, request_id: str, num_computed: int, tokens_of: TokensOf) -> None:
        """Name the request's blocks that `num_computed` tokens have filled."""
        if self.prefix is None:
            return
        hashes = self._hashes.setdefault(request_id, [])
        held = self._held.get(request_id, [])
        bs = self.block_size
        for i in range(len(hashes), min(num_computed // bs, len(held))):
            hashes.append(self.blocks.register(held[i], hashes[-1] if hashes else ROOT, tokens_of(i * bs, (i + 1) * bs)))

    def checkpoint(self, request_id: str, position: int, tokens_of: TokensOf, reason: str) -> Checkpoint | None:
        """Save the request's KDA state at `position` (its computed tokens, as of the last step)
        as a checkpoint, if the policy admits it; the save runs at the start of the next step."""
        if self.prefix is None or position <= 0 or not self.prefix.admits(reason) or request_id not in self._slot_of:
            return None
        self.register(request_id, position, tokens_of)
        bs = self.block_size
        full = position // bs
        hashes = self._hashes[request_id]
        parent = hashes[full - 1] if full else ROOT
        tail = tuple(tokens_of(full * bs, position))
        if (same := self.checkpoints.exact(parent, tail)) is not None:
            self.checkpoints.use(same)
            return same
        block = self._held[request_id][full] if tail else None
        nbytes = self.prefix.state_bytes + (self.prefix.block_bytes if block is not None else 0)
        if len(self.checkpoints) == self.checkpoints.capacity:
            victim = self.checkpoints.evict(list(self.checkpoints.live.values()))
            if victim is None:  # every checkpoint is in use this step
                return None
            if victim.block is not None:
                self.blocks.release([victim.block])
        c = self.checkpoints.add(parent, tail, position, block, self.prefix.prefill_cost(position), max(nbytes, 1))
        if block is not None:
            self.blocks.acquire(block)
        self._ops.saves.append((self._slot_of[request_id], c.id))
        return c
