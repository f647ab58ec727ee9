"""KDA decode steps on the cache's state table: write-back, and ReplaySSM.

write-back   each step reads a request's state, updates it, writes it back.
replay       the state table holds a checkpoint S0; the request's ring holds what each step
             since the checkpoint added (key, cumulative log-decay, delta-rule update), and a
             step's output is computed from S0 and the ring, writing only its ring entry.
             A full ring is folded into S0, exactly, in one pass. The maths is in
             `native/kda_decode.c`'s header; rejecting speculative tokens only moves the
             host's ring count back.

Each function runs the native kernel (in place on the table, fp32 or bf16, no gathered
copies) on CPU, and the batched torch version elsewhere; the torch version is what the kernel
is tested against, and both against the token-by-token reference. A bf16 table is computed
in fp32 and rounded where the torch version rounds it: a step's new state, a fold's checkpoint.
`counts[b]` is how many entries request b's ring holds before the step (the host keeps
them: `oxserve.cache.replay`); a count equal to the ring length means fold first.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from typing import TYPE_CHECKING

import torch

from oxserve.kernels import native
from oxserve.kernels.kda import SAFE_CHUNK_DECAY, kda_recurrent_step

if TYPE_CHECKING:
    from oxserve.cache.layers import ReplayRing
    from oxserve.cache.replay import RingCounts

# Contracted multiply-adds (ISO C mode turns them off): within fp32 rounding of the torch version.
BUILD_FLAGS = native.NATIVE_ISA + native.OPENMP + ("-O3", "-ffp-contract=fast")


def replay_exact(lower_bound: float | None, ring_len: int) -> bool:
    """Whether the ring must keep plain keys and form exp(G_t - G_j) per entry: the decay
    accumulated over a full ring can leave fp32's normal range (see the kernel's header)."""
    return lower_bound is None or ring_len * abs(lower_bound) > SAFE_CHUNK_DECAY


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    lib = native.load("kda_decode", BUILD_FLAGS)
    if lib is None:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.kda_writeback_step.argtypes = [p] * 7 + [i64, i32, i32, i32, i32, p, i32]
    lib.kda_replay_step.argtypes = [p] * 11 + [i64, i32, i32, i32, i32, i32, i32, p, i32]
    lib.kda_replay_fold.argtypes = [p] * 6 + [i64, i32, i32, i32, i32, i32, i32, i32]
    lib.kda_replay_run.argtypes = [p] * 13 + [i64, i32, i32, i32, i32, i32, i32, p, i32]
    lib.kda_writeback_run.argtypes = [p] * 10 + [i64, i32, i32, i32, i32, p, i32]
    return lib


@functools.cache
def _max_dim() -> int:
    return _kernel().kda_decode_max_dim()


def _native(states: torch.Tensor, ring: ReplayRing | None, *inputs: torch.Tensor) -> ctypes.CDLL | None:
    """The kernel, where it can run on these tensors in place: a contiguous fp32 or bf16
    state table, everything else contiguous fp32."""
    lib = _kernel()
    tensors = inputs + ((ring.keys, ring.decays, ring.deltas) if ring is not None else ())
    if lib is None or states.device.type != "cpu" or max(states.shape[-2:]) > _max_dim():
        return None
    if states.dtype not in (torch.float32, torch.bfloat16) or not states.is_contiguous():
        return None
    if not all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors):
        return None
    return lib


def _bf16(states: torch.Tensor) -> int:
    return int(states.dtype == torch.bfloat16)


def _check(status: int, what: str) -> None:
    """A kernel's status: -1 head dims above its own (`_native` rules them out), otherwise no
    scratch memory for a bf16 table's fp32 copies."""
    if status == -1:
        raise ValueError(f"{what}: head dims above the kernel's {_max_dim()}")
    if status != 0:
        raise MemoryError(f"{what}: no scratch memory for the states' fp32 copies (status {status})")


def _ptrs(*tensors: torch.Tensor) -> list[ctypes.c_void_p]:
    return [native.pointer(t) for t in tensors]


def _inputs(q, k, v, g, beta) -> tuple[torch.Tensor, ...]:
    return tuple(t.float().contiguous() for t in (q, k, v, g, beta))


# ---- write-back -------------------------------------------------------------------------


def writeback_step(states: torch.Tensor, slots: torch.Tensor, q, k, v, g, beta) -> torch.Tensor:
    """One token per request: q, k, g [B, H, Dk], v [B, H, Dv], beta [B, H]; states
    [slots, H, Dk, Dv] updated in place at `slots` [B]. Returns o [B, H, Dv] (fp32)."""
    q, k, v, g, beta = _inputs(q, k, v, g, beta)
    slots = slots.contiguous()
    lib = _native(states, None, q, k, v, g, beta)
    if lib is None:
        return writeback_step_torch(states, slots, q, k, v, g, beta)
    (b, h, dk), dv = q.shape, v.shape[-1]
    out = q.new_empty(b, h, dv)
    _check(lib.kda_writeback_step(*_ptrs(q, k, v, g, beta, states, slots), b, h, dk, dv, _bf16(states),
                                  native.pointer(out), torch.get_num_threads()), "kda_writeback_step")
    return out


def writeback_step_torch(states, slots, q, k, v, g, beta) -> torch.Tensor:
    out, new = kda_recurrent_step(q, k, v, g, beta, states.index_select(0, slots).float())
    states.index_copy_(0, slots, new.to(states.dtype))
    return out


def writeback_run_fits(states: torch.Tensor) -> bool:
    """Whether `writeback_run` can run on this state table (in place: CPU, fp32 or bf16)."""
    return _native(states, None) is not None


def writeback_run(states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, lens: list[int], q, k, v, g, beta) -> torch.Tensor:
    """Prompt chunks: lens[b] consecutive write-back steps per request (tokens packed request
    after request, q, k, g [T, H, Dk], v [T, H, Dv], beta [T, H]) on the table's states at
    `slots`, each zeroed first where `fresh` [R] (bool) says the request has no context.
    Needs `writeback_run_fits(states)`. Returns o [T, H, Dv] (fp32)."""
    q, k, v, g, beta = _inputs(q, k, v, g, beta)
    slots = slots.to(torch.int64).contiguous()  # held here, as every tensor below: C gets addresses only
    lib = _native(states, None, q, k, v, g, beta)
    if lib is None:
        raise ValueError("writeback_run: needs the native kernel, a contiguous fp32 or bf16 state table and fp32 CPU inputs")
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    host = [torch.tensor(x, dtype=torch.int64) for x in (starts, lens)]
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    fresh = fresh.to(device="cpu", dtype=torch.uint8).contiguous()
    decay = g.exp()  # held here: the kernel gets its address only
    status = lib.kda_writeback_run(*_ptrs(q, k, v, decay, beta, states, slots, *host, fresh), len(lens), q.shape[1],
                                   q.shape[2], v.shape[-1], _bf16(states), native.pointer(out), torch.get_num_threads())
    if status == -1:
        raise ValueError(f"writeback_run: head dims {q.shape[2]}, {v.shape[-1]} are above the kernel's {_max_dim()}")
    _check(status, "kda_writeback_run")
    return out


# ---- replay ------------------------------------------------------------------------------


def replay_step(states: torch.Tensor, ring: ReplayRing, slots: torch.Tensor, counts: list[int],
                count_tensor: torch.Tensor, q, k, v, g, beta) -> torch.Tensor:
    """As `writeback_step`, but the table keeps checkpoints and the step writes ring entry
    counts[b] (after folding a full ring). `count_tensor`: `counts` as int64 on the device."""
    q, k, v, g, beta = _inputs(q, k, v, g, beta)
    slots = slots.contiguous()
    lib = _native(states, ring, q, k, v, g, beta)
    if lib is None:
        return replay_step_torch(states, ring, slots, counts, q, k, v, g, beta)
    (b, h, dk), dv = q.shape, v.shape[-1]
    out = q.new_empty(b, h, dv)
    _check(lib.kda_replay_step(*_ptrs(q, k, v, g, beta, states, ring.keys, ring.decays, ring.deltas, slots, count_tensor),
                               b, h, dk, dv, ring.length, int(ring.exact), _bf16(states), native.pointer(out),
                               torch.get_num_threads()), "kda_replay_step")
    return out


def replay_fold(states: torch.Tensor, ring: ReplayRing, slots: torch.Tensor, counts: list[int], count_tensor: torch.Tensor) -> None:
    """Fold each request's first counts[b] ring entries into its checkpoint."""
    if not any(counts):
        return
    slots = slots.contiguous()
    lib = _native(states, ring)
    if lib is None:
        replay_fold_torch(states, ring, slots, counts)
        return
    h, dk, dv = states.shape[1:]
    _check(lib.kda_replay_fold(*_ptrs(states, ring.keys, ring.decays, ring.deltas, slots, count_tensor), slots.numel(),
                               h, dk, dv, ring.length, int(ring.exact), _bf16(states), torch.get_num_threads()),
           "kda_replay_fold")


def replay_verify(states: torch.Tensor, ring: ReplayRing, slots: torch.Tensor, rings: RingCounts, lens: list[int],
                  q, k, v, g, beta) -> torch.Tensor:
    """Runs of lens[b] consecutive decode steps per request (tokens packed request after
    request), each step's entry appended to the ring after `rings.verifies[b]`; a ring that
    cannot take them all is folded first. Returns o [sum(lens), H, Dv]. The kernel reads the
    counts from `rings`' tensors and folds by itself (a captured step replays it); the torch
    path reads them on the host."""
    q, k, v, g, beta = _inputs(q, k, v, g, beta)
    slots = slots.contiguous()
    lib = _native(states, ring, q, k, v, g, beta)
    if lib is not None:  # each request's run in one pass
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        status = lib.kda_replay_run(*_ptrs(q, k, v, g, beta, states, ring.keys, ring.decays, ring.deltas, slots,
                                           rings.verify_counts, rings.verify_starts, rings.verify_lens),
                                    len(lens), q.shape[1], q.shape[2], v.shape[-1], ring.length, int(ring.exact),
                                    _bf16(states), native.pointer(out), torch.get_num_threads())  # fmt: skip
        if status == -2:
            raise ValueError(f"a verified run of {max(lens)} tokens does not fit a replay ring of {ring.length}")
        _check(status, "kda_replay_run")
        return out
    counts = list(rings.verifies)
    full = [b for b, (c, n) in enumerate(zip(counts, lens)) if c + n > ring.length]
    if full:
        pending = [counts[b] for b in full]
        replay_fold(states, ring, slots[full], pending, torch.tensor(pending, device=slots.device))
        counts = [0 if b in full else c for b, c in enumerate(counts)]
    return replay_verify_torch(states, ring, slots, counts, lens, q, k, v, g, beta)


def replay_verify_torch(states, ring: ReplayRing, slots, counts: list[int], lens: list[int], q, k, v, g, beta) -> torch.Tensor:
    """`replay_verify` one step at a time (counts already leave room for lens)."""
    starts = list(itertools.accumulate(lens, initial=0))[:-1]  # each run's first token
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32)
    for i in range(max(lens)):
        rows = [b for b, n in enumerate(lens) if n > i]
        tokens = torch.tensor([starts[b] + i for b in rows], device=q.device)
        step_counts = [counts[b] + i for b in rows]
        step = (t.index_select(0, tokens) for t in (q, k, v, g, beta))
        out[tokens] = replay_step_torch(states, ring, slots[rows], step_counts, *step)
    return out


class _Gathered:
    """The rings of a batch of requests, [B, H, R, ...], and which entries are live."""

    def __init__(self, ring: ReplayRing, slots: torch.Tensor, counts: list[int]):
        self.keys, self.decays, self.deltas = (t.index_select(0, slots) for t in (ring.keys, ring.decays, ring.deltas))
        n = torch.tensor(counts, device=slots.device)
        self.live = (torch.arange(ring.length, device=slots.device) < n[:, None])[:, None, :, None]  # [B, 1, R, 1]
        last = (n - 1).clamp(min=0).view(-1, 1, 1, 1).expand(-1, self.decays.shape[1], 1, self.decays.shape[-1])
        self.last_decay = torch.where(n.view(-1, 1, 1) > 0, self.decays.gather(2, last).squeeze(2), 0.0)  # G_n [B, H, Dk]
        self.exact = ring.exact

    def decayed_keys(self, decay: torch.Tensor) -> torch.Tensor:
        """k_j * exp(G - G_j) for a cumulative log-decay G [B, H, Dk]; zero for dead entries."""
        if self.exact:
            w = self.keys * (decay.unsqueeze(2) - self.decays).exp()
        else:
            w = self.keys * decay.exp().unsqueeze(2)
        return torch.where(self.live, w, 0.0)


def replay_fold_torch(states, ring: ReplayRing, slots, counts: list[int]) -> None:
    rings = _Gathered(ring, slots, counts)
    s0 = states.index_select(0, slots).float()
    folded = s0 * rings.last_decay.exp().unsqueeze(-1) + rings.decayed_keys(rings.last_decay).transpose(-1, -2) @ rings.deltas
    states.index_copy_(0, slots, folded.to(states.dtype))


def replay_step_torch(states, ring: ReplayRing, slots, counts: list[int], q, k, v, g, beta) -> torch.Tensor:
    full = [i for i, c in enumerate(counts) if c == ring.length]
    if full:
        replay_fold_torch(states, ring, slots[full], [ring.length] * len(full))
        counts = [0 if c == ring.length else c for c in counts]
    rings = _Gathered(ring, slots, counts)
    decay = rings.last_decay + g  # G_t
    qk = torch.stack([q, k], dim=2)  # [B, H, 2, Dk]
    s0 = states.index_select(0, slots).float()
    # rows: q^T and k^T times S_{t-1} decayed by this step: the checkpoint's part, then the ring's
    read = (qk * decay.exp().unsqueeze(2)) @ s0 + (qk @ rings.decayed_keys(decay).transpose(-1, -2)) @ rings.deltas
    delta = beta.unsqueeze(-1) * (v - read[:, :, 1])
    out = read[:, :, 0] + (q * k).sum(-1, keepdim=True) * delta
    key = k if ring.exact else k * (-decay).exp()
    heads = torch.arange(q.shape[1], device=slots.device)
    rows = (slots[:, None] * q.shape[1] + heads) * ring.length + torch.tensor(counts, device=slots.device)[:, None]
    for table, value in ((ring.keys, key), (ring.decays, decay), (ring.deltas, delta)):
        table.view(-1, table.shape[-1]).index_copy_(0, rows.flatten(), value.reshape(-1, table.shape[-1]))
    return out
