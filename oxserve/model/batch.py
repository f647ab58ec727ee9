"""Per-step metadata for one flat, packed batch of tokens from many requests.

The runner builds a `ForwardBatch` once per step with `make_forward_batch`; the model only
reads it, and nothing in the model reads a tensor back to the host to find its way.
Requests are ordered with decodes (one new token on top of a cached context) first, then
prefill chunks:

    tokens:   | d0 | d1 | d2 | v0 v0 v0 | p0 p0 p0 p0 p0 | p1 p1 p1 |
    requests:   0    1    2    3          4               5
    num_decodes = 3, num_verifies = 1, query_lens = [1, 1, 1, 3, 5, 3]

A verify (speculative decoding) is a decode with drafts: its last real token and the drafts
after it, run as consecutive decode steps, with logits at every position.

Paged cache layout (MLA latents, indexer keys): a cache row is `block * block_size + offset`;
request r's token at position p lives in row `block_tables[r, p // block_size] * block_size
+ p % block_size`. Indexer pool keys use the same blocks with `block_size // kpool` pools each.
Block tables are padded with `num_blocks`, an id that no cache has: a stray read fails.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from oxserve.cache.replay import ReplayBook, RingCounts
from oxserve.kernels.kda import ChunkLayout, ConvLayout, chunk_layout, chunk_plan, conv_layout
from oxserve.model.config import TextModelConfig
from oxserve.telemetry import Tracer


class BlockIds:
    """A request's cache block ids, append-only: as a Python list (host arithmetic) and as an
    int64 array grown with it, so a step's block table is filled from arrays instead of
    converting every id of every request from Python each step (32 requests at 16k context:
    2.0 ms a step against 0.26 ms, `python docs/bench/forward_batch_cost.py`)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self._buffer = np.empty(16, dtype=np.int64)

    def extend(self, ids: list[int]) -> None:
        if not ids:
            return
        start, end = len(self.ids), len(self.ids) + len(ids)
        if end > self._buffer.size:
            grown = np.empty(max(end, 2 * self._buffer.size), dtype=np.int64)
            grown[:start] = self._buffer[:start]
            self._buffer = grown
        self._buffer[start:end] = ids
        self.ids.extend(ids)

    def array(self) -> np.ndarray:
        return self._buffer[: len(self.ids)]


def host_tensor(values, device: torch.device | str, dtype=np.int64) -> torch.Tensor:
    """A tensor of a host list, through numpy: torch.tensor converts it value by value, and a
    step makes about ten such index tensors (three ints: 10 us against 3.4 us on this
    project's slowest cores; `python docs/bench/forward_batch_cost.py` for a whole step)."""
    tensor = torch.from_numpy(np.asarray(values, dtype=dtype))  # an int64 array as it is
    return tensor if torch.device(device).type == "cpu" else tensor.to(device)


@dataclass(slots=True)
class BatchRequest:
    """One request's share of a step, as the runner knows it. Not changed once made (not
    frozen, as `ScheduledRequest`: one is made a request and step)."""

    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int]
    state_slot: int
    samples: bool
    num_draft_tokens: int = 0  # speculative tokens at the end, verified this step
    scored_positions: range = range(0)  # more positions (in the request) whose logits are wanted: prompt logprobs
    block_array: np.ndarray | None = None  # block_ids as int64 (`BlockIds.array`), where the caller keeps one

    @property
    def verifies(self) -> bool:
        """A token on a cached context plus drafts: decode steps, with logits at every one."""
        return self.num_computed_tokens > 0 and self.num_draft_tokens > 0


@dataclass(frozen=True)
class PoolCompletions:
    """Indexer pools that this step's tokens complete: where their members are, where the
    compressed key goes."""

    member_rows: torch.Tensor  # [N, kpool] cache rows of each pool's tokens
    pool_rows: torch.Tensor  # [N] pool-cache rows


@dataclass
class ForwardBatch:
    query_lens: list[int]  # new tokens per request this step
    context_lens: list[int]  # tokens already in the cache before this step
    num_decodes: int  # the first num_decodes requests are single-token decodes
    positions: torch.Tensor  # [T] long, position of each token within its request
    request_index: torch.Tensor  # [T] long, which request each token belongs to
    cache_rows: torch.Tensor  # [T] long, paged-cache row each token's entries are written to
    block_tables: torch.Tensor  # [R, max_blocks] long, padded with num_blocks
    state_slots: torch.Tensor  # [R] long, KDA state slot of each request
    has_initial_state: torch.Tensor  # [R] bool, the request has cached context (else states start at zero)
    block_size: int
    # The longest sequence of the step (cached + new tokens) rounded up to a power of two: what
    # decode work is sized by (the indexer's pool scores), so that a step's shapes stay the same
    # while its contexts grow (a captured step replays them: `oxserve.engine.capture`).
    seq_len_bound: int
    # [S + P] long, token rows whose logits are wanted: each request's sampling row(s) in
    # batch order, then each request's scored_positions in batch order.
    logits_indices: torch.Tensor
    conv: ConvLayout | None = None  # KDA conv over all requests
    query_runs: torch.Tensor | None = None  # [R, 2] long on the host: each request's (first token row, count)
    chunks: ChunkLayout | None = None  # KDA chunked delta rule over the prefill requests
    pools: PoolCompletions | None = None  # indexer pools completed this step
    rings: RingCounts | None = None  # KDA ReplaySSM ring counts (None: states are written back)
    num_verifies: int = 0  # after the decodes: requests verifying drafts (decode steps over several tokens)
    tracer: Tracer | None = None  # telemetry: per-op spans when profiling

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def query_start(self) -> list[int]:
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        return starts

    @property
    def seq_lens(self) -> list[int]:
        return [c + q for c, q in zip(self.context_lens, self.query_lens)]

    def rows_for_positions(self, request: int | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Cache rows of `positions` (any shape, -1 = none) for `request` (int or broadcastable tensor)."""
        safe = positions.clamp(min=0)
        blocks = self.block_tables[request, safe // self.block_size]
        return blocks * self.block_size + safe % self.block_size

    def pool_rows(self, request: int | torch.Tensor, pools: torch.Tensor, kpool: int) -> torch.Tensor:
        """Pool-cache rows of pool indices `pools` for `request`."""
        pools_per_block = self.block_size // kpool
        safe = pools.clamp(min=0)
        blocks = self.block_tables[request, safe // pools_per_block]
        return blocks * pools_per_block + safe % pools_per_block


def token_runs(query_lens: list[int]) -> torch.Tensor:
    """[R, 2] int64 on the host: each request's first token row and token count, tokens packed in order."""
    runs, start = [], 0
    for n in query_lens:
        runs.append((start, n))
        start += n
    return host_tensor(runs, "cpu").view(len(query_lens), 2)


def make_forward_batch(
    requests: list[BatchRequest],
    cfg: TextModelConfig,
    block_size: int,
    num_blocks: int,
    device: torch.device | str,
    rings: ReplayBook | None = None,
    kda: bool = True,
) -> ForwardBatch:
    """Every piece of step metadata, from host-side lists (for 8+ plain decodes, partly as
    array arithmetic). With ReplaySSM, `rings` is the host's book of ring counts, advanced past
    this step. `kda=False`: for layers without KDA (the MTP layer's), no KDA layouts."""
    seq_len_bound, width = table_shape(requests, block_size)
    tables = np.full((len(requests), width), num_blocks, dtype=np.int64)
    for r, req in enumerate(requests):
        tables[r, : len(req.block_ids)] = req.block_ids if req.block_array is None else req.block_array
    plain_decodes = len(requests) >= VECTOR_DECODES and all(
        req.num_computed_tokens > 0 and req.num_new_tokens == 1 and req.samples and not req.num_draft_tokens
        and not req.scored_positions for req in requests)  # fmt: skip
    if plain_decodes:
        positions, request_index, cache_rows, logits_indices = _decode_rows(requests, tables, block_size, num_blocks)
        num_decodes, num_verifies = len(requests), 0
    else:
        positions, request_index, cache_rows, logits_indices, num_decodes, num_verifies = _token_rows(requests, block_size)

    def as_long(values) -> torch.Tensor:
        return host_tensor(values, device)

    query_lens = [req.num_new_tokens for req in requests]
    batch = ForwardBatch(
        query_lens=query_lens,
        context_lens=[req.num_computed_tokens for req in requests],
        num_decodes=num_decodes,
        positions=as_long(positions),
        request_index=as_long(request_index),
        cache_rows=as_long(cache_rows),
        block_tables=host_tensor(tables, device),
        state_slots=as_long([req.state_slot for req in requests]),
        has_initial_state=host_tensor([req.num_computed_tokens > 0 for req in requests], device, np.bool_),
        block_size=block_size,
        seq_len_bound=seq_len_bound,
        logits_indices=as_long(logits_indices),
        num_verifies=num_verifies,
    )
    verify_lens = query_lens[num_decodes : num_decodes + num_verifies]
    if kda and cfg.kda_layers:
        size, exact = chunk_plan(cfg.linear_lower_bound)
        batch.conv, batch.query_runs, batch.chunks = _kda_layouts(
            tuple(query_lens), num_decodes, num_verifies, cfg.linear_conv_kernel_dim, size, exact, device)
    if rings is not None:
        has_context = [req.num_computed_tokens > 0 for req in requests]
        batch.rings = rings.advance([req.state_slot for req in requests], has_context, num_decodes, device, verify_lens)
    elif num_verifies and kda and cfg.kda_layers:
        raise ValueError("verifying draft tokens needs ReplaySSM rings for the KDA layers (--kda-decode replay)")
    if cfg.full_indexer_layers:
        if plain_decodes:
            member_rows, pool_rows = _decode_pool_rows(positions, tables, cfg.index_kpool, block_size)
            batch.pools = PoolCompletions(member_rows=host_tensor(member_rows, device), pool_rows=host_tensor(pool_rows, device))
        else:
            batch.pools = _pool_completions(requests, cfg.index_kpool, block_size, device)
    return batch


class DecodeRows:
    """The batch of a captured step of plain decodes (one sampled token a request, each with
    context), written in place for each step of its shape (`write`): the same request count
    and `table_shape`, so what its tensors hold beyond a request's rows (request and logits
    rows, KDA layouts) stays as made. A row is a few integers computed in Python and stored
    through memoryviews; a block table row is rewritten only when its request's blocks change.
    numpy's calls cost 8-10 us each on caches a replay has just swept (a batch-1 step's
    metadata as arrays took 0.22 ms of a 2.3 ms step on a first-generation EPYC). CPU tensors
    only."""

    def __init__(self, batch: ForwardBatch, token_ids: torch.Tensor):
        if batch.num_decodes != batch.num_requests or batch.num_tokens != batch.num_requests:
            raise ValueError(f"a batch of {batch.num_requests} requests and {batch.num_tokens} tokens is not one of plain decodes")
        self.size, self.block_size = batch.num_requests, batch.block_size
        self._tokens, self._positions, self._cache_rows, self._slots = (
            _ints(t) for t in (token_ids, batch.positions, batch.cache_rows, batch.state_slots))
        self._members = self._pools = self._counts = None
        if batch.pools is not None:
            self._members, self._pools = _ints(batch.pools.member_rows), _ints(batch.pools.pool_rows)
        if batch.rings is not None:
            self._counts = _ints(batch.rings.decode_counts)
        self._table = batch.block_tables.numpy()
        self._table_rows: list[tuple[list[int], int] | None] = [None] * self.size  # (the ids each row holds, how many)

    def forget(self) -> None:
        """Its tensors were written by someone else (a whole batch copied in): every table row
        is rewritten at the next `write`."""
        self._table_rows = [None] * self.size

    def write(self, requests: list[BatchRequest], token_ids: list[int], num_blocks: int, kpool: int,
              rings: ReplayBook | None = None) -> None:
        """This step's `requests` and their `token_ids` (one each); `num_blocks` pads the table
        (as `make_forward_batch`'s); with ReplaySSM, `rings` is advanced past this step."""
        if len(requests) != self.size or len(token_ids) != self.size:
            raise ValueError(f"{len(requests)} decodes do not fit a batch made for {self.size}")
        if (rings is None) != (self._counts is None):
            raise ValueError("ReplaySSM rings given for a batch made without them, or the reverse")
        block_size = self.block_size
        pools_per_block = block_size // kpool
        try:
            for r, req in enumerate(requests):
                ids, position = req.block_ids, req.num_computed_tokens
                self._table_row(r, ids, num_blocks)
                self._tokens[r], self._positions[r], self._slots[r] = token_ids[r], position, req.state_slot
                self._cache_rows[r] = ids[position // block_size] * block_size + position % block_size
                if self._members is not None:  # the pool the token is in (`_decode_pool_rows`)
                    first = position - position % kpool
                    row = ids[first // block_size] * block_size + first % block_size
                    for i in range(kpool):
                        self._members[r * kpool + i] = row + min(i, position - first)
                    pool = position // kpool
                    self._pools[r] = ids[pool // pools_per_block] * pools_per_block + pool % pools_per_block
        except IndexError:
            raise ValueError("a decode's position lies past the blocks its request holds") from None
        if rings is not None:
            for r, count in enumerate(rings.advance_decodes([req.state_slot for req in requests])):
                self._counts[r] = count

    def _table_row(self, r: int, ids: list[int], num_blocks: int) -> None:
        """Row r of the block table holds `ids` (a request's append-only list) padded with
        `num_blocks`; rewritten from where it last differed."""
        held = self._table_rows[r]
        if held is not None and held[0] is ids and held[1] == len(ids):
            return
        start = held[1] if held is not None and held[0] is ids and held[1] < len(ids) else 0
        if len(ids) > self._table.shape[1]:
            raise ValueError(f"{len(ids)} blocks do not fit a block table {self._table.shape[1]} wide")
        self._table[r, start : len(ids)] = ids[start:]
        if start == 0:
            self._table[r, len(ids) :] = num_blocks
        self._table_rows[r] = (ids, len(ids))


def _ints(t: torch.Tensor) -> memoryview:
    """An int64 CPU tensor's elements, flat, as a writable memoryview (each store a few ns)."""
    if t.dtype != torch.int64 or not t.is_contiguous():
        raise ValueError(f"expected a contiguous int64 tensor, got {t.dtype}")
    return memoryview(t.numpy().reshape(-1))


# From this many plain decodes a step's rows and pools are built as array arithmetic: 146 -> 94 us
# at 32 requests, 70 -> 67 at 8, but 39 -> 49 at 1 (numpy's cost a call; `python
# docs/bench/forward_batch_cost.py`, on an AMX Xeon).
VECTOR_DECODES = 8


def _decode_rows(requests: list[BatchRequest], tables: np.ndarray, block_size: int, num_blocks: int) -> tuple[np.ndarray, ...]:
    """`_token_rows` of a step of plain decodes (one sampled token a request), as arrays:
    positions, request index, cache rows, logits rows."""
    positions = np.fromiter((req.num_computed_tokens for req in requests), np.int64, len(requests))
    rows = np.arange(len(requests))
    blocks = tables[rows, positions // block_size]
    if (blocks == num_blocks).any():  # (the table's padding: the list path's IndexError)
        raise ValueError("a decode's position lies past the blocks its request holds")
    cache_rows = blocks * block_size + positions % block_size
    return positions, rows, cache_rows, rows.copy()


def _token_rows(requests: list[BatchRequest], block_size: int) -> tuple[list[int], list[int], list[int], list[int], int, int]:
    """Each new token's position, request and cache row; the rows whose logits are wanted;
    the numbers of decodes and verifies (checked to come first, in that order)."""
    positions: list[int] = []
    request_index: list[int] = []
    cache_rows: list[int] = []
    logits_indices: list[int] = []
    scored_rows: list[int] = []
    num_decodes = num_verifies = 0
    for r, req in enumerate(requests):
        start, end = req.num_computed_tokens, req.num_computed_tokens + req.num_new_tokens
        if req.verifies:
            if num_decodes + num_verifies != r:
                raise ValueError("verifies must come right after the decodes in a batch")
            num_verifies += 1
        elif start > 0 and req.num_new_tokens == 1:
            if num_decodes != r:
                raise ValueError("decodes must come before verifies and prefill chunks in a batch")
            num_decodes += 1
        first = len(positions)
        positions += range(start, end)
        request_index += [r] * req.num_new_tokens
        cache_rows += [req.block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
        if req.verifies:
            logits_indices += range(first, len(positions))
        elif req.samples:
            logits_indices.append(len(positions) - 1)
        if req.scored_positions and not start <= req.scored_positions[0] <= req.scored_positions[-1] < end:
            raise ValueError(f"scored positions {req.scored_positions} are outside this step's tokens [{start}, {end})")
        scored_rows += [first + p - start for p in req.scored_positions]
    return positions, request_index, cache_rows, logits_indices + scored_rows, num_decodes, num_verifies


@functools.lru_cache(maxsize=64)
def _kda_layouts(query_lens: tuple[int, ...], num_decodes: int, num_verifies: int, conv_kernel: int, chunk_size: int,
                 exact: bool, device: torch.device | str) -> tuple[ConvLayout, torch.Tensor, ChunkLayout]:
    """The KDA layers' conv layout, token runs and prefill chunk layout, which depend on the
    query lengths only: a decode step of a batch size met before reuses them (read-only index
    tensors) instead of building ~10 tensors from Python lists, about a tenth of a batch-1
    step's host time on a slow core."""
    lens = list(query_lens)
    conv = conv_layout(lens, conv_kernel, device, windows_from=num_decodes, num_windowed=num_verifies)
    return conv, token_runs(lens), chunk_layout(lens[num_decodes + num_verifies :], chunk_size, exact, device)


def table_shape(requests: list[BatchRequest], block_size: int) -> tuple[int, int]:
    """(seq_len_bound, block table width) of a step of `requests`: what its shapes depend on
    besides the tokens' count. Tables are as wide as the blocks of seq_len_bound tokens (or a
    power of two past that): their width changes when the bound does, a few times in a
    request's life."""
    seq_len_bound = power_of_two(max(req.num_computed_tokens + req.num_new_tokens for req in requests))
    return seq_len_bound, max(power_of_two(max(len(req.block_ids) for req in requests)), -(-seq_len_bound // block_size))


def power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def _pool_completions(requests: list[BatchRequest], kpool, block_size, device) -> PoolCompletions:
    """The pools each request's new tokens complete; a decode also gets its own pool when it
    does not complete one, from the tokens it has so far (a partial key, overwritten when the
    pool completes, never read before: queries see complete pools only), so that a decode step
    always compresses one pool per request (its shapes do not change from step to step)."""
    members: list[int] = []  # kpool cache rows a pool, pools one after another
    pool_rows: list[int] = []
    pools_per_block = block_size // kpool
    for req in requests:
        table = req.block_ids
        start, end = req.num_computed_tokens, req.num_computed_tokens + req.num_new_tokens
        ends = range(start + (kpool - 1 - start) % kpool, end, kpool)  # positions that end a pool
        if start > 0 and req.num_new_tokens == 1 and not ends:
            ends = [start]
        for last in ends:
            first = last - last % kpool  # a pool lies in one block (block_size is a multiple of kpool)
            row = table[first // block_size] * block_size + first % block_size
            members += [row + min(i, last - first) for i in range(kpool)]
            pool = last // kpool
            pool_rows.append(table[pool // pools_per_block] * pools_per_block + pool % pools_per_block)
    return PoolCompletions(
        member_rows=host_tensor(members, device).reshape(-1, kpool),
        pool_rows=host_tensor(pool_rows, device),
    )


def _decode_pool_rows(positions: np.ndarray, tables: np.ndarray, kpool: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`_pool_completions` of a step of plain decodes, as array arithmetic (member rows, pool
    rows): each decode's pool is the one its token is in (complete or partial), whose members
    run from the pool's first position to the token (the token's row repeated past it)."""
    rows = np.arange(len(positions))
    first = positions - positions % kpool
    member_rows = tables[rows, first // block_size] * block_size + first % block_size
    member_rows = member_rows[:, None] + np.minimum(np.arange(kpool), (positions - first)[:, None])
    pools_per_block = block_size // kpool
    pool = positions // kpool
    pool_rows = tables[rows, pool // pools_per_block] * pools_per_block + pool % pools_per_block
    return member_rows, pool_rows
