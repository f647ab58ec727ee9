"""`oxserve experiment run | list | show | plot`: controlled A/B experiments and their ledger."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from oxserve.cli import add_engine_arguments, engine_config_from_args
from oxserve.experiment.arms import parse_arm
from oxserve.experiment.launch import WorkerError
from oxserve.experiment.procedure import Settings, run_experiment
from oxserve.options import changed_options
from oxserve.feedback.ledger import ExperimentRecord, Ledger, LedgerError, default_ledger_path, plot_metric
from oxserve.feedback.stats import ALPHA, NOISE_THRESHOLD
from oxserve.feedback.workload import load_workload


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--ledger", type=Path, default=None, help=f"ledger file (default: {default_ledger_path()})")
    if command == "run":
        parser.add_argument("--a", required=True, help="arm A: key=value,..., an options file, or git:REV[,key=value...]")
        parser.add_argument("--b", required=True, help="arm B, same forms as --a")
        parser.add_argument("--workload", required=True, help="workload file, or the name of a shipped one")
        parser.add_argument("--pairs", type=int, default=5, help="A/B pairs at least (default: %(default)s)")
        parser.add_argument("--max-pairs", type=int, default=16, help="pairs at most, when noisy (default: %(default)s)")
        parser.add_argument("--noise", type=float, default=NOISE_THRESHOLD,
                            help="noise threshold on the median ratio (default: %(default)s)")
        parser.add_argument("--alpha", type=float, default=ALPHA, help="Mann-Whitney significance level (default: %(default)s)")
        parser.add_argument("--metric", default="output_tokens_per_s", help="the rate compared (default: %(default)s)")
        parser.add_argument("--quality-bound", type=float, default=0.05,
                            help="largest per-token logprob divergence of B from A, nats (default: %(default)s)")
        parser.add_argument("--quality-prompts", type=int, default=4, help="prompts in the quality set (default: %(default)s)")
        parser.add_argument("--quality-tokens", type=int, default=16,
                            help="greedy tokens per quality prompt (default: %(default)s)")
        parser.add_argument("--output-bound", type=float, default=0.25,
                            help="nats per token by which B's workload outputs may be less likely than A's, both "
                                 "scored by A (the output check; default: %(default)s)")
        parser.add_argument("--experiment-seed", type=int, default=0, help="seed of the run order and the quality prompts")
        parser.add_argument("--run-timeout", type=float, default=1800.0, help="seconds one run may take (default: %(default)s)")
        parser.add_argument("--description", default="", help="what this experiment tests")
        parser.add_argument("--json", action="store_true", help="print the finished record as JSON")
        add_engine_arguments(parser)  # shared by both arms; an arm's own options win
    elif command == "list":
        parser.add_argument("--limit", type=int, default=20, help="newest N experiments (default: %(default)s)")
    elif command == "show":
        parser.add_argument("id", type=int, help="experiment id")
        parser.add_argument("--json", action="store_true", help="print JSON")
    elif command == "plot":
        parser.add_argument("--out", type=Path, required=True, help="PNG file to write")
        parser.add_argument("--metric", default="output_tokens_per_s", help="metric to plot (default: %(default)s)")
        parser.add_argument("--workload", default=None, help="only experiments on this workload")


def run(args: argparse.Namespace) -> int:
    command = args.command_path[-1]
    try:
        if command == "run":
            return _run(args)
        ledger = _open_existing(args.ledger)
        with ledger:
            if command == "list":
                print(format_list(ledger.list(args.limit)))
            elif command == "show":
                record = ledger.get(args.id)
                print(json.dumps(record_dict(record), indent=1) if args.json else format_record(record))
            else:
                print(plot_metric(ledger, args.out, args.metric, args.workload))
        return 0
    except (LedgerError, ValueError) as e:
        print(f"oxserve experiment {command}: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    with Ledger(args.ledger) as ledger:  # a bad ledger fails here, before any run
        settings = Settings(
            a=parse_arm("A", args.a), b=parse_arm("B", args.b), workload=load_workload(args.workload),
            base_options=changed_options(engine_config_from_args(args)), pairs=args.pairs, max_pairs=args.max_pairs,
            noise_threshold=args.noise, alpha=args.alpha, metric=args.metric, quality_bound=args.quality_bound, output_bound=args.output_bound,
            quality_prompts=args.quality_prompts, quality_tokens=args.quality_tokens, seed=args.experiment_seed,
            run_timeout_s=args.run_timeout, threads=args.threads, description=args.description,
        )
        try:
            record = run_experiment(settings, ledger)
        except WorkerError as e:
            print(f"oxserve experiment run: {e}\n(the experiment is recorded as failed in {ledger.path})", file=sys.stderr)
            return 1
    print(json.dumps(record_dict(record), indent=1) if args.json else format_record(record))
    return 0


def _open_existing(path: Path | None) -> Ledger:
    """list/show/plot read a ledger; they never create an empty one by accident."""
    target = Path(path).expanduser() if path is not None else default_ledger_path()
    if not target.exists():
        raise LedgerError(f"no ledger at {target}: run an experiment first, or pass --ledger")
    return Ledger(target)


def record_dict(r: ExperimentRecord) -> dict:
    return dataclasses.asdict(r)


def format_list(records: list[ExperimentRecord]) -> str:
    lines = [f"{'id':>4}  {'created':<20} {'status':<9} {'workload':<14} {'verdict':<26} {'ratio':>7}  {'quality':<7}  change"]
    for r in records:
        ratio = f"{r.stats['median_ratio']:.3f}" if r.stats else "-"
        quality = "-" if r.quality is None else ("pass" if r.quality["passed"] else "FAIL")
        change = (r.config_diff.splitlines() or ["(A/A)"])[0]
        lines.append(f"{r.id:>4}  {r.created_at[:19]:<20} {r.status:<9} {r.workload_name:<14} "
                     f"{r.verdict or '-':<26} {ratio:>7}  {quality:<7}  {change}")
    return "\n".join(lines)


def format_record(r: ExperimentRecord) -> str:
    lines = [f"experiment {r.id} ({r.status}), {r.created_at} -> {r.finished_at or '...'}"]
    if r.description:
        lines.append(f"  {r.description}")
    lines.append(f"workload: {r.workload_name}")
    lines.append("A vs B:" if r.config_diff else "A vs B: identical (A/A)")
    lines += [f"  {line}" for line in r.config_diff.splitlines()]
    lines.append(f"A source: {r.config_a.get('source')}; B source: {r.config_b.get('source')}")
    if r.stats:
        s = r.stats
        lines.append(f"verdict: {r.verdict} -- {s['reason']}")
        lines.append(f"  {s['metric']}: median A {s['median_a']:.4g}, median B {s['median_b']:.4g}; "
                     f"median B/A {s['median_ratio']:.4f}, {s['confidence']:.0%} CI [{s['ci_low']:.4f}, {s['ci_high']:.4f}], "
                     f"Mann-Whitney p = {s['p_value']:.3g} ({s['n_pairs']} pairs, noise threshold {s['noise_threshold']:.0%})")
        lines.append(f"  roofline (max {s['metric']}): " + ", ".join(f"{k} {v:.4g}" for k, v in s["rooflines"].items()))
        latency = [f"{name} p50 A {s['medians']['A'][key] * 1e3:.1f} ms, B {s['medians']['B'][key] * 1e3:.1f} ms"
                   for name, key in (("TTFT", "ttft_p50_s"), ("TPOT", "tpot_p50_s"))
                   if key in s.get("medians", {}).get("A", {}) and key in s["medians"].get("B", {})]
        if latency:
            lines.append("  latency (median over runs): " + "; ".join(latency))
    if r.quality:
        q = r.quality
        lines.append(f"quality gate: {'passed' if q['passed'] else 'FAILED'} -- max divergence {q['max_divergence']:.4g} nats "
                     f"(bound {q['bound']}), mean {q['mean_divergence']:.4g}, greedy agreement {q['argmax_agreement']:.0%} "
                     f"over {q['positions']} positions of {q['prompts']} prompts")
    if r.accepted is not None:
        lines.append(f"accepted: {'yes' if r.accepted else 'no'}")
    if r.error:
        lines.append(f"error: {r.error}")
    lines.append(f"samples ({len(r.samples)}):")
    for s in r.samples:
        rate = s.metrics.get("output_tokens_per_s")
        lines.append(f"  run {s.run_index:>2} {s.arm}: {rate:.4g} tok/s, wall {s.wall_time_s:.2f} s" if rate is not None
                     else f"  run {s.run_index:>2} {s.arm}: {s.metrics}")
    return "\n".join(lines)
