"""Run a model on tp × ls ranks (tensor parallelism, Layer Split): real processes joined by a gloo process group."""

from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from oxserve.model.forced import forced_logits
from oxserve.model.loader import load_model
from oxserve.parallel.groups import form_groups
from oxserve.parallel.workers import free_port


def _forced_on_rank(rank: int, tp: int, ls: int, ep: bool, port: int, path: str, tokens: list[int], chunk: int, decode_from: int | None,
                    replay: int, shuffle_seed: int, out: str) -> None:  # fmt: skip
    torch.set_num_threads(1)
    timeout = timedelta(seconds=120)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp * ls, timeout=timeout)
    try:
        placement = form_groups(rank, tp, ls, timeout, expert_parallel=ep)
        model = load_model(path, dtype=torch.float32, tp=placement.tp, ls=placement.ls).model
        logits = forced_logits(model, tokens, chunk, decode_from, shuffle=random.Random(shuffle_seed), kda_replay=replay)
        assert (logits is None) == (rank != 0), "logits belong on the first rank only"
        if rank == 0:
            torch.save(logits, out)
    finally:
        dist.destroy_process_group()


def tp_forced_logits(path: Path, tp: int, ls: int, ep: bool, tokens: list[int], chunk: int, decode_from: int | None, replay: int,
                     shuffle_seed: int, workdir: Path) -> torch.Tensor:  # fmt: skip
    """`forced_logits` of the checkpoint at `path` cut among tp × ls ranks (`ep`: experts cut by
    expert), from the first rank."""
    out = workdir / f"tp{tp}-ls{ls}-logits.pt"
    args = (tp, ls, ep, free_port(), str(path), tokens, chunk, decode_from, replay, shuffle_seed, str(out))
    mp.start_processes(_forced_on_rank, args=args, nprocs=tp * ls, start_method="spawn")
    return torch.load(out)
