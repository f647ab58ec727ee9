"""`oxserve profile`: run a workload in-process with telemetry on; write trace.json, a report
and the run's token ids (sequences.json)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import torch

from oxserve.cli import add_engine_arguments, engine_config_from_args
from oxserve.engine.engine import LLMEngine
from oxserve.engine.speculative import acceptance
from oxserve.feedback.ceilings import load_or_measure_ceilings
from oxserve.feedback.drive import PROMPT_MIN_TOKEN_ID, run_workload
from oxserve.options import changed_options
from oxserve.feedback.workload import Arrival, load_workload
from oxserve.profiling.analysis import analyse
from oxserve.profiling.costs import model_storage
from oxserve.profiling.overhead import end_to_end_overhead, measure_span_cost, span_overhead
from oxserve.profiling.report import build_report, write_report
from oxserve.profiling.spans import group_spans
from oxserve.profiling.trace import write_trace
from oxserve.telemetry import Tracer


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--workload", required=True, help="workload file, or the name of a shipped one (e.g. smoke)")
    parser.add_argument("--out", type=Path, required=True, help="directory for trace.json, report.md, report.json")
    parser.add_argument("--max-requests", type=int, default=None, help="profile only the first N requests of the workload")
    parser.add_argument("--overhead-repeats", type=int, default=3,
                        help="end-to-end overhead check: runs of a short segment with and without telemetry, each (0: skip)")
    parser.add_argument("--ceilings", choices=("full", "quick", "none"), default="full",
                        help="this machine's ceilings for the roofline: cached full measurement, quick one, or none")
    add_engine_arguments(parser)


def prefix_cache_summary(before, after) -> dict:
    """The prefix cache over the profiled run, from two `EngineStats`."""
    delta = {k: getattr(after, f"prefix_{k}") - getattr(before, f"prefix_{k}")
             for k in ("queries", "hits", "requests", "hit_requests", "checkpoint_evictions")}  # fmt: skip
    return {**delta, "hit_rate": delta["hits"] / delta["queries"] if delta["queries"] else 0.0,
            "checkpoints": after.prefix_checkpoints, "checkpoint_capacity": after.prefix_checkpoint_capacity}


def _captured_counts(engine: LLMEngine) -> tuple[int, int]:
    captured = engine.runner.captured
    return (captured.replays, captured.captures) if captured is not None else (0, 0)


def run(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    workload = load_workload(args.workload)
    args.out.mkdir(parents=True, exist_ok=True)
    engine = LLMEngine(config)
    requests = workload.requests(engine.model_config.vocab_size, min_token_id=PROMPT_MIN_TOKEN_ID,
                                 model_dir=engine.model_path)
    requests = requests[: args.max_requests]
    # One short untraced request first: lazy initialisation is not what we want to see.
    warm = dataclasses.replace(requests[0], sampling={**dict(requests[0].sampling), "max_tokens": 2})
    run_workload(engine, [warm], Arrival(concurrency=1))

    tracer = Tracer(engine.device)
    engine.runner.tracer = tracer
    before, captured_before = engine.stats(), _captured_counts(engine)
    result = run_workload(engine, requests, workload.arrival, tracer)
    after, captured_after = engine.stats(), _captured_counts(engine)
    engine.runner.tracer = None
    steps = group_spans(tracer.spans)
    write_trace(steps, args.out / "trace.json", {"workload": workload.name, "model": str(engine.model_path)})
    # The token ids, for what reads the run's text: the agent replays n-gram lookup on them.
    (args.out / "sequences.json").write_text(json.dumps([{"prompt": list(r.prompt), "output": list(r.output)}
                                                         for r in result.requests]))

    ceilings = None if args.ceilings == "none" else load_or_measure_ceilings(str(engine.device), quick=args.ceilings == "quick")
    elem_bytes = torch.empty((), dtype=engine.dtype).element_size()
    storage = model_storage(engine.runner.model, engine.dtype, engine.cache_plan, engine.kda_replay)
    analysis = analyse(steps, engine.model_config, elem_bytes, ceilings, storage)
    step_durations = [s.dur_us for s in steps]
    overhead = {"spans": span_overhead(measure_span_cost(), len(tracer.spans) / len(steps), statistics.median(step_durations))}
    if args.overhead_repeats > 0:
        overhead["end_to_end"] = end_to_end_overhead(engine, requests, workload.arrival, args.overhead_repeats)

    metrics = result.metrics()
    run_info = {
        "model": str(engine.model_path), "dtype": config.model.dtype, "device": str(engine.device),
        "threads": torch.get_num_threads(),
        "workload": workload.name, "workload_spec": workload.to_dict(),
        "engine_options": changed_options(config), "num_requests": len(requests),
        "output_tokens": int(metrics["num_output_tokens"]), "wall_s": result.wall_s,
        "output_tokens_per_s": metrics["output_tokens_per_s"], "metrics": metrics,
        "num_preemptions": after.num_preemptions - before.num_preemptions,
    }
    if engine.speculative:
        run_info["spec_decode"] = acceptance(*(getattr(after, k) - getattr(before, k)
                                               for k in ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")))
    if engine.runner.captured is not None:
        replays, captures = (b - a for a, b in zip(captured_before, captured_after))
        passes = sum(1 for s in steps for f in s.forwards if f.shape.capturable)  # decodes and verifies
        run_info["captured_decode"] = {"replays": replays, "captures": captures, "eager": passes - replays - captures}
    if engine.prefix_caching:
        run_info["prefix_cache"] = prefix_cache_summary(before, after)
    report = build_report(run_info, analysis, overhead, ceilings.to_dict() if ceilings else None)
    md_path, json_path = write_report(report, args.out)
    for line in report["headline"]:
        print(line)
    print(f"wrote {args.out / 'trace.json'}, {md_path}, {json_path}")
    return 0
