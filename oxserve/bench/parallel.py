"""`oxserve bench parallel`: the parallel layouts' cost model, measured here and checked against
real multi-process runs; then its predictions for GLM-5.3-Flash on 8 accelerators.

1. Collectives between CPU processes of this host (gloo), at sizes from 256 bytes to 4 MiB.
2. For each layout (TP x LS) on the model given (default: the embedded one), a decode step
   predicted as rank 0's piece timed alone (its collectives skipped) + the engine's own work
   per step (measured on one process: its step minus its forward) + the step's collectives;
   then measured, by running the layout's real ranks. The one-process layout calibrates the
   engine's work, so it is not a check; the others are.
3. GLM-5.3-Flash's shape on 8 devices: each rank's weights and cache bytes (from the model
   built on the meta device, so exact), the tokens that fit, and a decode step predicted from
   the per-op bytes at a stated memory bandwidth plus collectives at stated NCCL costs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from oxserve.cache.spec import bytes_per_request, bytes_per_token
from oxserve.cli import add_engine_arguments, engine_config_from_args
from oxserve.engine.engine import DTYPES
from oxserve.model.config import TextModelConfig
from oxserve.parallel.cost_model import (
    CollectiveCosts,
    Curve,
    Layout,
    PieceAlone,
    collective_time,
    concurrent_compute,
    measure_collectives,
    roofline_compute,
    step_collectives,
    timed_forward,
)
from oxserve.parallel.layer_split import LayerSplit

TARGET_LAYOUTS = "8x1,4x2,2x4"


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--layouts", default="1x1,2x1,1x2", help="TPxLS layouts run on this host (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="decode requests per step (default: %(default)s)")
    parser.add_argument("--context", type=int, default=512, help="tokens of context per request (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=12, help="decode steps timed per layout (default: %(default)s)")
    parser.add_argument("--no-validate", action="store_true", help="predict only: do not run the layouts' real ranks")
    parser.add_argument("--target-layouts", default=TARGET_LAYOUTS, help="GLM-5.3-Flash layouts on 8 devices (default: %(default)s)")
    parser.add_argument("--target-batch", type=int, default=64, help="GLM-5.3-Flash: decode requests per step (default: %(default)s)")
    parser.add_argument("--target-context", type=int, default=32768, help="GLM-5.3-Flash: tokens of context (default: %(default)s)")
    parser.add_argument("--target-bandwidth-gbs", type=float, default=4800.0,
                        help="the target devices' memory bandwidth, GB/s (default: %(default)s, H200 HBM3e)")
    parser.add_argument("--target-memory-gib", type=float, default=141.0, help="memory per target device, GiB (default: %(default)s)")
    parser.add_argument("--target-collective-us", type=float, default=20.0,
                        help="latency of one NCCL collective between the target devices, us (default: %(default)s)")
    parser.add_argument("--target-link-gbs", type=float, default=150.0,
                        help="collective bus bandwidth between the target devices, GB/s (default: %(default)s, NVLink-class)")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this file")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    if config.model.device != "cpu":
        raise SystemExit("oxserve bench parallel measures CPU ranks over gloo only; NCCL between GPUs is not built yet")
    path = Path(config.model.model) if config.model.model else _default_model()
    dtype = DTYPES[config.model.dtype]
    layouts = [_layout(text) for text in args.layouts.split(",")]
    cores = len(os.sched_getaffinity(0))
    report: dict = {"model": str(path), "dtype": config.model.dtype, "batch": args.batch, "context": args.context, "cores": cores}

    with tempfile.TemporaryDirectory() as tmp:
        costs = measure_collectives(max(2, *(layout.ranks for layout in layouts)), Path(tmp))
    report["collectives"] = costs.to_json()
    sizes = [size for size, _ in next(iter(costs.curves.values())).points]
    print(f"collectives between {costs.ranks} processes ({costs.backend}), mean us by bytes:")
    print("  " + " " * 11 + "".join(f"{_bytes(size):>9}" for size in sizes))
    for kind, curve in costs.curves.items():
        print(f"  {kind:<11}" + "".join(f"{t * 1e6:9.0f}" for _, t in curve.points))

    threads = {layout: max(1, cores // layout.ranks) for layout in layouts}
    engine_work = {t: _engine_work(path, dtype, t, args) for t in set(threads.values())}
    report["layouts"] = here = [_layout_row(path, dtype, layout, costs, threads[layout], engine_work[threads[layout]], args)
                                for layout in layouts]  # fmt: skip
    print(f"\ndecode step at batch {args.batch}, context {args.context}, on {cores} cores (ms):")
    print("  layout        threads  compute  engine  collectives  predicted  measured  error")
    for row in here:
        measured = f"{row['measured_s'] * 1e3:8.1f}  {row['error'] * 100:+5.1f}%" if "measured_s" in row else "       -      -"
        print(f"  {row['layout']:<13} {row['threads']:>7}  {row['compute_s'] * 1e3:7.1f}  {row['engine_s'] * 1e3:6.1f}  "
              f"{row['collectives_s'] * 1e3:11.1f}  {row['predicted_s'] * 1e3:9.1f}  {measured}")  # fmt: skip

    target = _target_rows(args)
    report["glm_5_3_flash_8_devices"] = target
    print(f"\nGLM-5.3-Flash on 8 devices, bf16, decode batch {args.target_batch} at context {args.target_context} "
          f"({args.target_bandwidth_gbs:.0f} GB/s memory, {args.target_memory_gib:.0f} GiB each; "
          f"collectives {args.target_collective_us:.0f} us + bytes / {args.target_link_gbs:.0f} GB/s):")  # fmt: skip
    print("  layout        weights/rank  cache B/token/rank  KDA state/request/rank  tokens that fit  step ms (compute + collectives)")
    for row in target:
        fits = f"{row['tokens_that_fit']:>15,}" if row["tokens_that_fit"] > 0 else "   does not fit"
        print(f"  {row['layout']:<13} {row['weights_gib']:9.1f} GiB  {row['cache_bytes_per_token']:18,.0f}  "
              f"{row['state_mib_per_request']:18.1f} MiB  {fits}  {row['step_s'] * 1e3:.2f} "
              f"({row['compute_s'] * 1e3:.2f} + {row['collectives_s'] * 1e3:.2f})")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def _layout(text: str) -> Layout:
    tp, _, ls = text.strip().partition("x")
    return Layout(int(tp), int(ls or 1))


def _layout_row(path: Path, dtype: torch.dtype, layout: Layout, costs: CollectiveCosts, threads: int, engine: float,
                args) -> dict:  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        compute = concurrent_compute(path, layout, args.dtype, args.batch, args.context, args.steps, threads, Path(tmp))
    cfg = TextModelConfig.from_file(path)
    calls = step_collectives(cfg, layout, args.batch, args.context, dtype.itemsize)
    collectives = collective_time(costs, calls)
    row = {"layout": str(layout), "threads": threads, "compute_s": compute, "engine_s": engine, "collectives_s": collectives,
           "collective_calls": len(calls), "predicted_s": compute + engine + collectives}  # fmt: skip
    if not args.no_validate:
        row["measured_s"] = measured_decode_step(path, args.dtype, layout, threads, args.batch, args.context, args.steps)
        row["error"] = row["predicted_s"] / row["measured_s"] - 1
    return row


def _engine_work(path: Path, dtype: torch.dtype, threads: int, args) -> float:
    """The engine's work per decode step outside the forward (schedule, inputs, sample), at
    `threads`: one process's step minus its forward."""
    from oxserve.model.loader import load_model

    torch.set_num_threads(threads)
    forward = timed_forward(load_model(path, dtype=dtype).model, args.batch, args.context, args.steps)
    step = measured_decode_step(path, args.dtype, Layout(1), threads, args.batch, args.context, args.steps)
    return max(0.0, step - forward)


def measured_decode_step(path: Path, dtype: str, layout: Layout, threads: int, batch: int, context: int, steps: int) -> float:
    """Median seconds of the engine's decode-only steps with `batch` requests at `context`,
    on the layout's real ranks."""
    from oxserve import LLM, SamplingParams

    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    with LLM(str(path), dtype=dtype, threads=threads, tensor_parallel_size=layout.tp, layer_split_size=layout.ls,
             max_num_seqs=batch, enable_prefix_caching=False) as llm:  # fmt: skip
        engine = llm.engine
        for r in range(batch):
            engine.add_request(str(r), {"prompt_token_ids": [rng.randrange(2, 1000) for _ in range(context)]}, params)
        times: list[float] = []
        while len(times) < steps + 2 and engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            if engine.last_step.prefill_tokens == 0 and engine.last_step.decode_tokens == batch:
                times.append(time.perf_counter() - start)
    return statistics.median(times[2:] or times)


def _target_rows(args) -> list[dict]:
    cfg = TextModelConfig.from_hf_dict({})  # the reference's defaults: GLM-5.3-Flash's shape
    curve = Curve.linear(args.target_collective_us * 1e-6, args.target_link_gbs * 1e9)
    link = CollectiveCosts(8, "nccl (assumed)", {kind: curve for kind in ("all_reduce", "broadcast", "gather", "message")})
    rows = []
    for text in args.target_layouts.split(","):
        layout = _layout(text)
        weights, per_token, per_request = _rank_memory(cfg, layout)
        batch, context = args.target_batch, args.target_context
        free = args.target_memory_gib * 2**30 - weights - batch * per_request
        compute = roofline_compute(cfg, layout.tp, batch, context, 2, args.target_bandwidth_gbs * 1e9)
        collectives = collective_time(link, step_collectives(cfg, layout, batch, context, 2))
        rows.append({"layout": str(layout), "weights_gib": weights / 2**30, "cache_bytes_per_token": per_token,
                     "state_mib_per_request": per_request / 2**20, "tokens_that_fit": int(free // per_token) if free > 0 else 0,
                     "compute_s": compute, "collectives_s": collectives, "step_s": compute + collectives})  # fmt: skip
    return rows


def _bytes(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K" if n >= 1 << 10 else str(n)


def _rank_memory(cfg: TextModelConfig, layout: Layout) -> tuple[float, float, float]:
    """A rank's weight bytes (bf16), cache bytes per token and KDA state bytes per request
    (of the fullest Layer Split rank), from the model built on the meta device (no memory)."""
    from oxserve.model.glm5_next import Glm5NextForCausalLM

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as a bf16 checkpoint loads (the router's fp32 parts stay fp32)
    try:
        with torch.device("meta"):
            model = Glm5NextForCausalLM(cfg, tp=PieceAlone(0, layout.tp), ls=LayerSplit(0, layout.ls))
    finally:
        torch.set_default_dtype(default)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    fullest = max((model.cache_specs(torch.bfloat16, ls_rank=s) for s in range(layout.ls)), key=bytes_per_token)
    return float(weights), bytes_per_token(fullest), float(bytes_per_request(fullest))


def _default_model() -> Path:
    from oxserve.default_model import default_model

    return default_model()
