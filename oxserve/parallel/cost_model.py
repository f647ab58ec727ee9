"""What a parallel layout costs per decode step: one rank's compute plus the step's collectives.

    step(tp, ls)  =  compute of one rank's piece  +  sum over the step's collectives of
                     (latency + bytes / bandwidth)  +  the engine's own work on rank 0

Everything on a step's critical path runs in sequence: ranks wait for each other at every
collective, so a rank's compute and the collectives add. Layer Split changes no rank's compute
on the critical path (an MLA layer's attention runs once, on its owner's group, while the
others wait), only the collectives (one broadcast per MLA layer) and the cache each rank holds.

A rank's compute is measured on this host with every rank computing at once
(`concurrent_compute`: each process times its own piece, collectives skipped), because ranks
on one host share its memory bandwidth and caches: a piece timed alone on an idle machine runs
faster than it does beside the others. For a machine not at hand it is taken from the per-op
byte counts of `oxserve.profiling.costs` at a stated memory bandwidth (`roofline_compute`:
decode is bound by bytes on an accelerator).

Collectives are measured between CPU processes of this host over gloo (`measure_collectives`;
measuring NCCL between GPUs is not built) at sizes from 256 bytes to 4 MiB, and a call's time
is interpolated between them: gloo's time is not linear in bytes (it changes algorithm with
size), so one latency and one bandwidth would misprice the mid sizes a decode step sends.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from oxserve.model.config import TextModelConfig
from oxserve.parallel.tensor import TensorParallel
from oxserve.profiling.costs import OP_COSTS, Storage, decode_step_shape, layer_ops
from oxserve.telemetry import span

# Ops whose work tensor parallelism divides among ranks (heads, channels, experts, vocabulary);
# every other op (mHC, norms, the router, the replicated latent projection) runs whole on each rank.
TP_CUT_OPS = frozenset({
    "kda.qkv_proj", "kda.conv", "kda.gates", "kda.recurrent", "kda.out",
    "mla.q_proj", "mla.indexer", "mla.attention", "mla.o_proj",
    "moe.experts", "moe.shared", "mlp.dense", "lm_head",
})  # fmt: skip
KINDS = ("all_reduce", "broadcast", "gather", "message")
# The pickled step message of a decode step: 264, 781 and 2550 bytes for 1, 8 and 32 requests
# (`python docs/bench/step_message_bytes.py`, 37-character request ids).
MESSAGE_BYTES, MESSAGE_BYTES_PER_REQUEST = 190, 74
FP32 = 4


@dataclass(frozen=True)
class Layout:
    tp: int
    ls: int = 1

    @property
    def ranks(self) -> int:
        return self.tp * self.ls

    def __str__(self) -> str:
        return f"TP {self.tp} x LS {self.ls}"


@dataclass(frozen=True)
class Curve:
    """A collective's measured (bytes, seconds) points; between them a call's time is
    interpolated, past the largest extrapolated along the last segment."""

    points: tuple[tuple[float, float], ...]

    @staticmethod
    def linear(latency_s: float, bytes_per_s: float) -> Curve:
        return Curve(((0.0, latency_s), (1e9, latency_s + 1e9 / bytes_per_s)))

    def time(self, nbytes: float) -> float:
        sizes, times = zip(*self.points)
        if nbytes <= sizes[-1]:
            return float(np.interp(nbytes, sizes, times))
        (s0, t0), (s1, t1) = self.points[-2:]
        return t1 + (nbytes - s1) * (t1 - t0) / (s1 - s0)

    @property
    def latency_s(self) -> float:
        return self.points[0][1]

    @property
    def bytes_per_s(self) -> float:
        """At the largest size measured."""
        return self.points[-1][0] / self.points[-1][1]


@dataclass(frozen=True)
class CollectiveCosts:
    ranks: int
    backend: str
    curves: dict[str, Curve]

    def time(self, kind: str, nbytes: float) -> float:
        return self.curves[kind].time(nbytes)

    def to_json(self) -> dict:
        return {"ranks": self.ranks, "backend": self.backend, "points": {k: c.points for k, c in self.curves.items()}}


def step_collectives(cfg: TextModelConfig, layout: Layout, batch: int, context: int, elem_bytes: float) -> list[tuple[str, float]]:
    """(kind, bytes) of every collective one decode step of `batch` requests at `context`
    tokens makes, as oxserve's model code makes them."""
    from oxserve.model.batch import power_of_two

    if layout.ranks == 1:
        return []
    hidden = batch * cfg.hidden_size
    calls = [("message", MESSAGE_BYTES + MESSAGE_BYTES_PER_REQUEST * batch)]
    if layout.tp > 1:
        calls.append(("all_reduce", hidden * FP32))  # vocab-parallel embedding
        calls += [("all_reduce", hidden * FP32)] * (2 * cfg.num_hidden_layers)  # attention and MLP blocks
        pools = power_of_two(context + 1) // cfg.index_kpool  # sized by ForwardBatch.seq_len_bound
        if pools > cfg.index_topk // cfg.index_kpool:  # else every pool is kept, unscored
            calls += [("all_reduce", batch * pools * FP32)] * len(cfg.full_indexer_layers)  # scores before top-k
        calls.append(("gather", batch * -(-cfg.vocab_size // layout.tp) * FP32))  # logits to rank 0
    if layout.ls > 1:
        calls += [("broadcast", hidden * elem_bytes)] * len(cfg.mla_layers)  # owners' attention outputs
    return calls


def collective_time(costs: CollectiveCosts, calls: list[tuple[str, float]]) -> float:
    return sum(costs.time(kind, nbytes) for kind, nbytes in calls)


# ---- measuring the collectives -------------------------------------------------------------

SIZES = tuple(1 << k for k in range(8, 23, 2))  # 256 bytes to 4 MiB


def measure_collectives(ranks: int, workdir: Path, repeats: int = 30) -> CollectiveCosts:
    """Each kind timed (mean of `repeats`) at SIZES between `ranks` CPU processes of this host."""
    import torch.multiprocessing as mp

    from oxserve.parallel.workers import free_port

    out = workdir / "collectives.json"
    mp.start_processes(_time_on_rank, args=(ranks, free_port(), repeats, str(out)), nprocs=ranks, start_method="spawn")
    samples = json.loads(out.read_text())
    return CollectiveCosts(ranks, "gloo", {kind: Curve(tuple(map(tuple, samples[kind]))) for kind in KINDS})


def _time_on_rank(rank: int, ranks: int, port: int, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks,
                            timeout=timedelta(seconds=60))  # fmt: skip
    try:
        samples: dict[str, list] = {kind: [] for kind in KINDS}
        for nbytes in SIZES:
            x = torch.ones(nbytes // FP32)
            pieces = [torch.empty_like(x) for _ in range(ranks)] if rank == 0 else None
            payload = [bytes(nbytes) if rank == 0 else None]
            runs = {
                "all_reduce": lambda x=x: dist.all_reduce(x),
                "broadcast": lambda x=x: dist.broadcast(x, src=0),
                "gather": lambda x=x, pieces=pieces: dist.gather(x, pieces, dst=0),
                "message": lambda payload=payload: dist.broadcast_object_list(payload, src=0),
            }
            for kind, run in runs.items():
                run()  # warm
                times = []
                for _ in range(repeats):
                    dist.barrier()
                    start = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - start)
                samples[kind].append([nbytes, statistics.fmean(times)])  # a step pays the mean, tail included
        if rank == 0:
            Path(out).write_text(json.dumps(samples))
    finally:
        dist.destroy_process_group()


# ---- a rank's compute ----------------------------------------------------------------------


@dataclass(frozen=True)
class PieceAlone(TensorParallel):
    """Rank `rank`'s piece run by itself: its shapes and its work, with its collectives
    skipped. For timing only: its outputs are partial sums."""

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor:
        return x


def roofline_compute(cfg: TextModelConfig, tp: int, batch: int, context: int, elem_bytes: float,
                     bytes_per_s: float) -> float:  # fmt: skip
    """One rank's decode step at a memory bandwidth: the bytes of its ops (divided by `tp` for
    the ops tensor parallelism cuts) over `bytes_per_s`."""
    shape, storage = decode_step_shape(batch, context), Storage.dense(elem_bytes)
    ops = ["embed", "final_norm", "lm_head"] + [op for i in range(cfg.num_hidden_layers) for op in layer_ops(cfg, i)]
    moved = sum(OP_COSTS[op](cfg, shape, storage).bytes / (tp if op in TP_CUT_OPS else 1) for op in ops)
    return moved / bytes_per_s


def concurrent_compute(path: Path, layout: Layout, dtype: str, batch: int, context: int, steps: int, threads: int,
                       workdir: Path) -> float:  # fmt: skip
    """The slowest rank's decode forward when all `layout.ranks` ranks compute together, each
    its own tensor-parallel piece (the whole of it: under Layer Split the critical path runs
    every layer's attention once)."""
    import torch.multiprocessing as mp

    mp.start_processes(_compute_on_rank, args=(layout.tp, str(path), dtype, batch, context, steps, threads, str(workdir)),
                       nprocs=layout.ranks, start_method="spawn")  # fmt: skip
    return max(float((workdir / f"compute-{rank}.txt").read_text()) for rank in range(layout.ranks))


def _compute_on_rank(rank: int, tp: int, path: str, dtype: str, batch: int, context: int, steps: int, threads: int,
                     workdir: str) -> None:  # fmt: skip
    from oxserve.engine.engine import DTYPES
    from oxserve.model.loader import load_model

    torch.set_num_threads(threads)
    piece = load_model(path, dtype=DTYPES[dtype], tp=PieceAlone(rank % tp, tp)).model
    Path(workdir, f"compute-{rank}.txt").write_text(str(timed_forward(piece, batch, context, steps)))


def timed_forward(model, batch: int, context: int, steps: int, tracer=None) -> float:
    """Median seconds of a decode forward (and logits) of `batch` requests at `context` tokens
    on `model` as it is (a full model, or one rank's piece whose collectives do nothing)."""
    from oxserve.cache.spec import CacheLayout
    from oxserve.model.batch import BatchRequest, make_forward_batch

    cfg = model.config
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    block = max(64, cfg.index_kpool)
    per_request = -(-(context + 1) // block)
    layout = CacheLayout(num_blocks=batch * per_request, block_size=block, num_slots=batch)
    caches = [spec.allocate(layout, "cpu") for spec in model.cache_specs(dtype)]
    requests = [BatchRequest(context, 1, list(range(r * per_request, (r + 1) * per_request)), state_slot=r, samples=True)
                for r in range(batch)]  # fmt: skip
    input_ids = torch.randint(2, cfg.vocab_size, (batch,))
    times = []
    with torch.inference_mode():
        for step in range(steps + 2):
            fb = make_forward_batch(requests, cfg, block, layout.num_blocks, "cpu", None)
            fb.tracer = tracer if step >= 2 else None
            start = time.perf_counter()
            with span(fb.tracer, "forward"):
                model.compute_logits(model(input_ids, fb, caches))
            if step >= 2:  # two warm-up steps
                times.append(time.perf_counter() - start)
    return statistics.median(times)
