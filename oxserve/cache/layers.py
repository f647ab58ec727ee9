"""The cache objects layers read and write through: the only code that indexes cache tensors.

    MLACache (paged; row = block * block_size + offset, see ForwardBatch)
        latent      [num_blocks * block_size, kv_lora_rank]
        index_keys  [num_blocks * block_size, index_head_dim]           indexer key
        index_gates [num_blocks * block_size, index_head_dim]           pool gate score
        pool_keys   [num_blocks * block_size / kpool, index_head_dim]   one compressed key per complete pool
    KDACache (per request, row = state slot)
        conv        [num_slots, K-1, 3*H*D]   last K-1 conv inputs, oldest first
        recurrent   [num_slots, H, Dk, Dv]    delta-rule state, fp32 or bf16 (with a ring: the checkpoint)
        ring        ReplayRing or None        ReplaySSM: per slot, R steps since the checkpoint

Layers whose indexer is `shared` have no index tensors. Reads and writes go through
index_select / index_copy_ (2-3x faster than advanced indexing on CPU); the rows a step
writes are distinct, but for the padding rows of a captured step (`engine.padding`), which
share one block and slot whose values nothing else reads. Any paged table may be a
`ScaledRows` instead of a tensor: int8 or fp8 (e4m3) values with one fp32 scale per row,
quantized as they are stored and dequantized as the rows a step reads are gathered (never the
whole table); on CPU the native kernels read and write them in place (MLA attention, the
indexer's scores and key store, `kernels.rows.scaled_store_native`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from oxserve import huge_pages
from oxserve.cache.replay import RingCounts
from oxserve.kernels import kda_decode, kda_io
from oxserve.kernels.kda import ChunkLayout, kda_chunked
from oxserve.kernels.rows import rows_fit, scaled_store_fit, scaled_store_native, scatter_rows_native

FP8 = torch.float8_e4m3fn
QMAX = {torch.int8: 127.0, FP8: 448.0}  # the largest magnitude each stores
NATIVE_KINDS = {torch.int8: 1, FP8: 2}  # what the native kernels call each (`native/scaled_rows.h`)


@dataclass
class ScaledRows:
    """A paged table stored in int8 or fp8 with a per-row fp32 scale (max |row| / QMAX).
    fp8 values are kept as their bytes (uint8): CPU torch cannot index_copy_ float8."""

    values: torch.Tensor  # [R, W] int8, or uint8 holding float8_e4m3fn bytes
    scales: torch.Tensor  # [R] fp32
    dtype: torch.dtype  # int8 or float8_e4m3fn: what the values are
    read_as: torch.dtype  # what gathers return (the model's dtype)

    @classmethod
    def zeros(cls, rows: int, width: int, dtype: torch.dtype, read_as: torch.dtype, device) -> ScaledRows:
        storage = torch.int8 if dtype == torch.int8 else torch.uint8
        return cls(huge_pages.zeros((rows, width), storage, device), torch.ones(rows, device=device), dtype, read_as)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, W] -> (stored values [N, W], scales [N])."""
        x = x.float()
        amax = x.abs().amax(-1)
        scale = torch.where(amax > 0, amax / QMAX[self.dtype], torch.ones_like(amax))
        scaled = x / scale[:, None]
        if self.dtype == torch.int8:
            return scaled.round().clamp(-127, 127).to(torch.int8), scale
        return scaled.to(FP8).view(torch.uint8), scale

    def dequantize(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        v = values.float() if self.dtype == torch.int8 else values.view(FP8).float()
        return (v * scales[..., None]).to(self.read_as)

    def store(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        if scaled_store_fit(self.values, self.scales, x):  # one native pass: ~8 eager ops a store otherwise
            scaled_store_native(self.values, self.scales, NATIVE_KINDS[self.dtype], rows, x)
            return
        values, scales = self.quantize(x.reshape(rows.numel(), -1))
        self.values.index_copy_(0, rows.flatten(), values)
        self.scales.index_copy_(0, rows.flatten(), scales)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        flat = rows.flatten()
        values, scales = self.values.index_select(0, flat), self.scales.index_select(0, flat)
        return self.dequantize(values, scales).view(*rows.shape, self.values.shape[1])


Table = torch.Tensor | ScaledRows


def gather_rows(table: Table, rows: torch.Tensor) -> torch.Tensor:
    """table[rows] for row indices of any shape."""
    if isinstance(table, ScaledRows):
        return table.gather(rows)
    return table.index_select(0, rows.flatten()).view(*rows.shape, *table.shape[1:])


def scatter_rows(table: Table, rows: torch.Tensor, values: torch.Tensor) -> None:
    """table[rows] = values, for distinct row indices of any shape."""
    if isinstance(table, ScaledRows):
        table.store(rows, values)
        return
    if rows_fit(table, values):  # one native copy: index_copy_ costs tens of microseconds in a decode step
        scatter_rows_native(table, rows, values)
        return
    table.index_copy_(0, rows.flatten(), values.reshape(rows.numel(), *table.shape[1:]).to(table.dtype))


@dataclass
class MLACache:
    latent: Table
    index_keys: Table | None = None
    index_gates: torch.Tensor | None = None
    pool_keys: Table | None = None

    def store_latents(self, rows: torch.Tensor, latents: torch.Tensor) -> None:
        scatter_rows(self.latent, rows, latents)

    def latents(self, rows: torch.Tensor) -> torch.Tensor:
        return gather_rows(self.latent, rows)

    def store_index_keys(self, rows: torch.Tensor, keys: torch.Tensor, gates: torch.Tensor) -> None:
        scatter_rows(self.index_keys, rows, keys)
        scatter_rows(self.index_gates, rows, gates)

    def index_keys_at(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, pool gate scores) of the tokens in `rows`."""
        return gather_rows(self.index_keys, rows), gather_rows(self.index_gates, rows)

    def store_pool_keys(self, pool_rows: torch.Tensor, keys: torch.Tensor) -> None:
        scatter_rows(self.pool_keys, pool_rows, keys)

    def pool_keys_at(self, pool_rows: torch.Tensor) -> torch.Tensor:
        return gather_rows(self.pool_keys, pool_rows)


@dataclass
class ReplayRing:
    """ReplaySSM's ring, per state slot: for each step since the checkpoint, the key (times
    exp(-G) unless `exact`), the cumulative log-decay G from the checkpoint, and the
    delta-rule update (`oxserve.kernels.kda_decode`). fp32."""

    keys: torch.Tensor  # [num_slots, H, R, Dk]
    decays: torch.Tensor  # [num_slots, H, R, Dk]
    deltas: torch.Tensor  # [num_slots, H, R, Dv]
    exact: bool

    @property
    def length(self) -> int:
        return self.keys.shape[2]


@functools.lru_cache(maxsize=4)
def _window_picks(kept: tuple[int, ...], width: int, device: torch.device) -> torch.Tensor:
    """Rows of the staged windows [V * width, ...] that `KDACache.accept` keeps: made once a
    step for every KDA layer (a verify step's Python is what speculation must pay for)."""
    return torch.tensor([i * width + n for i, n in enumerate(kept)], device=device)


@dataclass
class KDACache:
    conv: torch.Tensor
    recurrent: torch.Tensor
    ring: ReplayRing | None = None
    # A step verifying drafts: (their slots, the conv state after each of their tokens),
    # until `accept` keeps the states of the tokens that were kept.
    staged_conv: tuple[torch.Tensor, torch.Tensor] | None = None

    def conv_states(self, slots: torch.Tensor) -> torch.Tensor:
        return gather_rows(self.conv, slots)

    def store_conv_states(self, slots: torch.Tensor, states: torch.Tensor) -> None:
        scatter_rows(self.conv, slots, states)

    def recurrent_states(self, slots: torch.Tensor) -> torch.Tensor:
        """fp32 whatever the state is stored in (the recurrence runs in fp32)."""
        return gather_rows(self.recurrent, slots).float()

    def store_recurrent_states(self, slots: torch.Tensor, states: torch.Tensor) -> None:
        scatter_rows(self.recurrent, slots, states)

    def decode(self, slots: torch.Tensor, rings: RingCounts | None, q, k, v, g, beta) -> torch.Tensor:
        """One delta-rule step for each request in `slots`, on the state table in place:
        write-back, or ReplaySSM when this cache has a ring (`rings`: the step's ring counts)."""
        if self.ring is None:
            return kda_decode.writeback_step(self.recurrent, slots, q, k, v, g, beta)
        return kda_decode.replay_step(self.recurrent, self.ring, slots, rings.decodes, rings.decode_counts, q, k, v, g, beta)

    def verify(self, slots: torch.Tensor, rings: RingCounts, lens: list[int], q, k, v, g, beta) -> torch.Tensor:
        """Runs of lens[b] decode steps (a token and its drafts) for each request in `slots`,
        appended to its ReplaySSM ring: rejecting some later moves the ring's count back."""
        if self.ring is None:
            raise ValueError("verifying draft tokens needs ReplaySSM rings (--kda-decode replay)")
        return kda_decode.replay_verify(self.recurrent, self.ring, slots, rings, lens, q, k, v, g, beta)

    def stage_conv(self, slots: torch.Tensor, windows: torch.Tensor) -> None:
        self.staged_conv = (slots, windows)

    def accept(self, kept: list[int]) -> None:
        """Per verifying request of the last step, the index of its last kept token: its conv
        state becomes the one after that token."""
        slots, windows = self.staged_conv
        self.staged_conv = None
        if isinstance(self.conv, torch.Tensor) and kda_io.accept_windows(self.conv, slots, windows, kept):
            return
        picks = _window_picks(tuple(kept), windows.shape[1], windows.device)
        scatter_rows(self.conv, slots, windows.flatten(0, 1).index_select(0, picks))

    def prefill(self, slots: torch.Tensor, has_initial_state: torch.Tensor, lens: list[int], chunks: ChunkLayout,
                q, k, v, g, beta) -> torch.Tensor:
        """Prompt chunks (lens[b] tokens of request b, packed) from each request's full state, or
        zeros where it has no context yet; the table keeps the states they end in. On CPU a
        token at a time on the table in place (`kda_decode.writeback_run`: the state stays in
        cache; a bf16 table's widened once a run); elsewhere chunk-parallel on gathered copies."""
        if kda_decode.writeback_run_fits(self.recurrent):
            return kda_decode.writeback_run(self.recurrent, slots, ~has_initial_state, lens, q, k, v, g, beta)
        states = self.recurrent_states(slots)
        initial = torch.where(has_initial_state.view(-1, 1, 1, 1), states, 0.0)
        out, final = kda_chunked(q, k, v, g, beta, initial, chunks)
        self.store_recurrent_states(slots, final)
        return out

    def settle(self, slots: torch.Tensor, rings: RingCounts | None) -> None:
        """Fold ring entries still pending into the checkpoints of `slots`, so that the
        table holds their full states (before a prefill chunk reads them)."""
        if self.ring is not None:
            kda_decode.replay_fold(self.recurrent, self.ring, slots, rings.prefills, rings.prefill_counts)


LayerCache = MLACache | KDACache | None  # None: a layer whose cache another rank holds (Layer Split)
