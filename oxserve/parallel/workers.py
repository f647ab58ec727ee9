"""Parallel ranks in processes: the engine's process is rank 0, and spawns the other ranks of
its host (N = tensor_parallel_size x layer_split_size ranks, placed by `oxserve.parallel.groups`;
with --nnodes, each other host runs its own ranks through `serve_node`).
Every rank holds its piece of the model and of the KDA states, and the MLA caches of its own
layers (all of them without Layer Split), and runs the same step from the same message:

    rank 0 (engine)                                ranks 1..N-1 (`serve_rank`)
    init_process_group ──────────────────────────> init_process_group
    load its piece, plan the cache
    broadcast RankPlan (layout, dtypes) ─────────> load its piece
    all_gather fingerprints: refuse a mismatch <─> (model shapes, layout, versions)
    [W8A8: calibration passes, fingerprints again] [the same passes, in step]
                                                   build a ModelRunner
    per step: broadcast ("step", SchedulerOutput, > runner.execute (same collectives; image
      the caches of requests it imports)            embeddings broadcast from rank 0)
    sample (the logits are gathered on rank 0)
    a handover: broadcast ("export", id, tokens) ─> gather every rank's piece of its caches
    close: broadcast None ───────────────────────> exit 0

A rank that dies closes its sockets, and gloo fails the collective on the others at once; a
rank that hangs fails it after `collective_timeout`. Either way rank 0 raises `ParallelError`,
which stops the engine (its requests fail with a clear error): a group that lost a rank
cannot compute anything, and its ranks may be mid-collective, so no step is retried.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import signal
import socket
from dataclasses import dataclass
from datetime import timedelta
from importlib.metadata import version

import torch
import torch.distributed as dist

from oxserve.cache.precision import CachePlan
from oxserve.cache.spec import CacheLayout
from oxserve.config import ParallelConfig
from oxserve.parallel.groups import Placement, form_groups

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0  # how long close() waits for a rank to exit before killing it
BROKEN_JOIN_TIMEOUT_S = 2.0  # the same after a failure: a rank that lost its group exits at once, or is hung


class ParallelError(RuntimeError):
    """A parallel rank failed, hung or disagrees: the engine cannot go on."""


@dataclass(frozen=True)
class RankPlan:
    """What every rank builds identically, decided by rank 0 once its own piece is loaded."""

    model_path: str
    dtype: str
    device: str
    linear_kernel: str
    threads: int
    cache_plan: CachePlan
    kda_replay: int
    layout: CacheLayout
    deterministic: bool
    num_checkpoints: int
    seed: int
    quantization: str = "none"  # W8A8 on load: every rank quantizes its piece, and calibrates with the others
    smoothquant_alpha: float = 0.0
    quantization_plan: str | None = None  # a plan file (per-layer weights), at the same path on every host
    vision: bool = False  # rank 0 runs a vision tower: the others receive its embeddings


def fingerprint(model: torch.nn.Module, layout: CacheLayout) -> dict:
    """What must agree across ranks: versions, the model's config and local shapes, the cache."""
    return {
        "oxserve": version("oxserve"),
        "torch": torch.__version__,
        "config": repr(model.config),
        "shapes": [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()],
        "layout": layout,
    }


def mismatch(prints: list[dict]) -> str | None:
    """What differs between rank 0's fingerprint and another rank's, if anything."""
    for rank, other in enumerate(prints[1:], start=1):
        differ = sorted(k for k in prints[0] if other.get(k) != prints[0][k])
        if differ:
            return (f"parallel rank {rank} differs from rank 0 in {', '.join(differ)}: every rank must run the same "
                    "oxserve, torch and checkpoint")  # fmt: skip
    return None


class WorkerGroup:
    """Rank 0's handle on the other ranks: start them, send them each step, stop them."""

    def __init__(self, config: ParallelConfig, device: torch.device):
        self.size = config.world_size
        tp, ls = config.tensor_parallel_size, config.layer_split_size
        self.broken = False
        port = config.master_port or free_port(config.master_addr)
        init = f"tcp://{config.master_addr}:{port}"
        timeout = timedelta(seconds=config.collective_timeout)
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.processes = _spawn_ranks(config, config.node_ranks[1:], init, backend)
        try:
            _join_group(backend, init, 0, self.size, timeout)
            self.placement = form_groups(0, tp, ls, timeout, config.enable_expert_parallel)
        except Exception as e:
            self._stop_processes()
            raise ParallelError(f"the {self.size} parallel ranks could not form a group at {init}: {e}") from e
        log.info("oxserve: %d parallel ranks: tensor parallelism %d x Layer Split %d (%s, %s)", self.size, tp, ls, backend,
                 init)  # fmt: skip

    def start(self, plan: RankPlan, model: torch.nn.Module) -> None:
        """Hand every rank the plan, then check that they all built the same thing."""
        self._collective(lambda: dist.broadcast_object_list([plan], src=0), "sharing the plan")
        self.compare(model, plan.layout)

    def compare(self, model: torch.nn.Module, layout: CacheLayout) -> None:
        """ParallelError unless every rank's fingerprint is rank 0's (every rank calls it)."""
        prints: list = [None] * self.size
        self._collective(lambda: dist.all_gather_object(prints, fingerprint(model, layout)), "comparing ranks")
        if (problem := mismatch(prints)) is not None:
            self.broken = True
            raise ParallelError(problem)

    def send(self, kind: str, *args) -> None:
        """Every other rank does `kind` with `args` (see `_run_message`)."""
        self._collective(lambda: dist.broadcast_object_list([(kind, *args)], src=0), f"sending a {kind} message")

    def guard(self, what: str):
        """A context for rank 0's own part of a step: a failed collective becomes ParallelError."""
        return _Guard(self, what)

    def _collective(self, run, what: str) -> None:
        with self.guard(what):
            run()

    def dead_ranks(self) -> list[int]:
        return [rank for rank, p in enumerate(self.processes, start=1) if not p.is_alive()]

    def close(self) -> None:
        """Stop every rank: tell them if the group still works, then make sure they exit."""
        if not self.broken and dist.is_initialized():
            try:
                dist.broadcast_object_list([None], src=0)
            except Exception:
                log.warning("parallel ranks did not take the stop message; stopping them", exc_info=True)
        self._stop_processes()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _stop_processes(self) -> None:
        wait = BROKEN_JOIN_TIMEOUT_S if self.broken else JOIN_TIMEOUT_S
        for process in self.processes:
            process.join(wait)
            if process.is_alive():
                process.kill()
                process.join()


class _Guard:
    def __init__(self, group: WorkerGroup, what: str):
        self.group, self.what = group, what

    def __enter__(self):
        if self.group.broken:
            raise ParallelError("the parallel ranks' group already failed; restart the engine")

    def __exit__(self, kind, error, tb):
        if error is None or isinstance(error, ParallelError):
            return False
        self.group.broken = True
        dead = self.group.dead_ranks()
        cause = f"rank(s) {', '.join(map(str, dead))} exited" if dead else f"{kind.__name__}: {error}"
        raise ParallelError(f"parallel ranks failed while {self.what}: {cause}") from error


def share_accepted(counts: list[int] | None, n: int) -> list[int]:
    """Speculative decoding: the drafts each of `n` verifying requests kept, from rank 0
    (which passes `counts`) to every rank (which pass None)."""
    box = torch.tensor(counts if counts is not None else [0] * n, dtype=torch.long)
    dist.broadcast(box, src=0)
    return box.tolist()


def serve_node(config: ParallelConfig, device: torch.device) -> int:
    """A host other than the first (--node-rank k > 0): run its ranks until rank 0 stops
    them; 0 when every rank exited cleanly."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    init = f"tcp://{config.master_addr}:{config.master_port}"
    log.info("oxserve: host %d of %d runs ranks %d..%d, joining %s", config.node_rank, config.nnodes, config.node_ranks[0],
             config.node_ranks[-1], init)  # fmt: skip
    processes = _spawn_ranks(config, config.node_ranks, init, backend)
    for process in processes:
        process.join()
    failed = [f"{p.name} ({p.exitcode})" for p in processes if p.exitcode]
    if failed:
        log.error("oxserve: rank(s) exited with an error: %s", ", ".join(failed))
    return 1 if failed else 0


STARTUP_TIMEOUT_S = 60.0  # at least this long for every rank to reach the rendezvous


def _join_group(backend: str, init: str, rank: int, world_size: int, timeout: timedelta) -> None:
    """The default process group. The rendezvous waits for process start-up (importing torch
    alone takes seconds on a slow machine), not the collective timeout, which may be short:
    the store gets its own, longer limit; collectives keep `timeout`."""
    host, port = init.removeprefix("tcp://").rsplit(":", 1)
    startup = max(timeout, timedelta(seconds=STARTUP_TIMEOUT_S))
    store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=startup)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _spawn_ranks(config: ParallelConfig, ranks: range, init: str, backend: str) -> list:
    spawn = multiprocessing.get_context("spawn")
    args = (config.tensor_parallel_size, config.layer_split_size, init, backend, config.collective_timeout,
            config.enable_expert_parallel)  # fmt: skip
    processes = [spawn.Process(target=serve_rank, args=(rank, *args), name=f"oxserve-rank{rank}", daemon=True) for rank in ranks]
    for process in processes:
        process.start()
    return processes


def serve_rank(rank: int, tp: int, ls: int, init: str, backend: str, timeout_s: float, expert_parallel: bool) -> None:
    """A rank other than 0: join the group, build this rank's runner, run each step rank 0 sends."""
    _die_with_parent()
    timeout = timedelta(seconds=timeout_s)
    _join_group(backend, init, rank, tp * ls, timeout)
    try:
        placement = form_groups(rank, tp, ls, timeout, expert_parallel)
        [plan] = _receive()
        if plan is None:  # rank 0 could not build its part: it stops the group before it starts
            return
        model, quantize = _load_piece(plan, placement)
        dist.all_gather_object([None] * tp * ls, fingerprint(model, plan.layout))
        if quantize is not None:  # in step with rank 0's calibration passes, then compared again
            from oxserve.tokenizer import Tokenizer

            quantize.finish(model, Tokenizer.from_dir(plan.model_path))
            dist.all_gather_object([None] * tp * ls, fingerprint(model, plan.layout))
        runner = _build_runner(plan, model)  # (its caches after calibration, as on rank 0)
        while (message := _receive()[0]) is not None:
            _run_message(runner, *message)
    finally:
        dist.destroy_process_group()


def _run_message(runner, kind: str, *args) -> None:
    """What rank 0's runner asks of the others: ("step", SchedulerOutput, {request id: the
    CacheSnapshot it imports}), ("settle", SchedulerOutput), ("export", request id, tokens)."""
    if kind == "step":
        out, imports = args
        runner.imports.update(imports)
        runner.execute(out)
    elif kind == "settle":
        runner.settle(*args)
    elif kind == "export":
        gather_pieces(runner.export_piece(*args))
    else:
        raise ParallelError(f"rank 0 sent an unknown message {kind!r}")


def gather_pieces(piece: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]] | None:
    """Every rank's piece of a request's caches, on rank 0 (global rank order); None elsewhere."""
    pieces = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(piece, pieces, dst=0)
    return pieces


def _receive() -> list:
    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box


def _load_piece(plan: RankPlan, placement: Placement):
    """This rank's piece of the model, quantized as rank 0's (deferred W8A8 modules wait for
    calibration), and the quantization to finish (None: none)."""
    from oxserve.engine.engine import DTYPES
    from oxserve.kernels.onednn import choose_linear_kernel
    from oxserve.model.loader import load_model
    from oxserve.quantization.on_load import choose_quantization, load_transform
    from oxserve.quantization.plan import QuantizationPlan

    device, dtype = torch.device(plan.device), DTYPES[plan.dtype]
    torch.set_num_threads(plan.threads)
    torch.manual_seed(plan.seed)
    _, kernel = choose_linear_kernel(plan.linear_kernel, device, dtype)
    layers = QuantizationPlan.load(plan.quantization_plan) if plan.quantization_plan else None
    quantize = choose_quantization(plan.quantization, device, plan.smoothquant_alpha, layers)
    model = load_model(plan.model_path, dtype=dtype, device=device, transform=load_transform(quantize, kernel),
                       tp=placement.tp, ls=placement.ls).model  # fmt: skip
    return model, quantize


def _build_runner(plan: RankPlan, model: torch.nn.Module):
    from oxserve.engine.engine import DTYPES
    from oxserve.engine.runner import ModelRunner
    from oxserve.multimodal.embedder import ReceivedEmbeddings

    device, dtype = torch.device(plan.device), DTYPES[plan.dtype]
    specs = model.cache_specs(dtype, plan.cache_plan, kda_replay=plan.kda_replay)
    embedder = ReceivedEmbeddings(model.config.hidden_size, dtype, device) if plan.vision else None
    return ModelRunner(model, plan.layout, specs, device, deterministic=plan.deterministic,
                       num_checkpoints=plan.num_checkpoints, embedder=embedder)  # fmt: skip


def _die_with_parent() -> None:
    """Linux: this rank is killed when the engine's process dies, however it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port(addr: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]
