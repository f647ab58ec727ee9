"""`oxserve bench kernels`: check and time every model op at model shapes.

Each op's candidates (today: the torch code the engine runs) are checked against a plain
reference on fresh random inputs with poisoned outputs, timed, and checked again on inputs
regenerated after timing (see `oxserve/profiling/opbench/harness.py`). A rejected candidate
makes the command exit with status 1.
"""

from __future__ import annotations

import argparse
import json

import torch

from oxserve.engine.engine import DTYPES
from oxserve.feedback.ceilings import load_or_measure_ceilings
from oxserve.feedback.machine import cache_bytes
from oxserve.model.config import TextModelConfig
from oxserve.profiling.opbench import REGISTRY, BenchShapes
from oxserve.profiling.opbench.harness import Result, run_case


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint directory or config.json for the shapes (default: the small default model)")
    parser.add_argument("--ops", default=None, help=f"comma-separated ops (default: all of {', '.join(sorted(REGISTRY))})")
    parser.add_argument("--impl", default=None, help="only this candidate implementation (default: all)")
    parser.add_argument("--batch", default="1,16", help="decode batch sizes (default: %(default)s)")
    parser.add_argument("--context", default="512", help="context / prompt chunk lengths (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="activation dtype (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before timing (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=20, help="timed calls (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first input set (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--ceilings", choices=("full", "quick", "none"), default="full",
                        help="roofline from this machine's ceilings: cached full, quick, or none (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = model_config(args.model)
    shapes = BenchShapes(batches=_ints(args.batch), contexts=_ints(args.context))
    names = args.ops.split(",") if args.ops else sorted(REGISTRY)
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise SystemExit(f"unknown op(s): {', '.join(unknown)}; known: {', '.join(sorted(REGISTRY))}")
    device = torch.device(args.device)
    ceilings = None if args.ceilings == "none" else load_or_measure_ceilings(str(device), quick=args.ceilings == "quick")
    results = bench(cfg, names, shapes, DTYPES[args.dtype], device, impl=args.impl, warmup=args.warmup,
                    reps=args.reps, seed=args.seed, ceilings=ceilings,
                    on_result=None if args.json else lambda r: print(format_row(r), flush=True),
                    on_start=None if args.json else lambda: print(HEADER, flush=True))
    if args.json:
        print(json.dumps({"model": args.model or "default", "dtype": args.dtype, "device": str(device),
                          "threads": torch.get_num_threads(),
                          "ceilings": ceilings.to_dict() if ceilings else None,
                          "results": [r.to_dict() for r in results]}, indent=1))
    rejected = [r for r in results if not r.passed]
    if rejected and not args.json:
        print(f"\n{len(rejected)} of {len(results)} rejected:")
        for r in rejected:
            print(f"  {r.op} [{r.case}] {r.impl}: {r.reason}")
    return 1 if rejected else 0


def bench(cfg, names, shapes, dtype, device, *, impl=None, warmup=3, reps=20, seed=0, ceilings=None,
          on_result=None, on_start=None) -> list[Result]:
    results = []
    if on_start:
        on_start()
    llc = cache_bytes(str(device))
    for name in names:
        op = REGISTRY[name]
        for case in op.cases(cfg, shapes, dtype, device):
            for impl_name, candidate in op.candidates.items():
                if impl is not None and impl_name != impl:
                    continue
                result = run_case(op, cfg, case, impl_name, candidate, device, warmup=warmup, reps=reps, seed=seed,
                                  ceilings=ceilings, cache_bytes=llc)
                results.append(result)
                if on_result:
                    on_result(result)
    return results


def model_config(path: str | None) -> TextModelConfig:
    if path is None:
        from oxserve.default_model import default_model

        path = default_model()
    return TextModelConfig.from_file(path)


HEADER = (f"{'op':<20} {'case':<16} {'impl':<8} {'status':<8} {'median µs':>10} {'p10-p90 µs':>17} "
          f"{'GB/s':>7} {'GFLOP/s':>8} {'roofline':>8}")


def format_row(r: Result) -> str:
    t = r.timing
    timing = f"{t.median_us:>10.1f} {f'{t.p10_us:.1f}-{t.p90_us:.1f}':>17}" if t else f"{'-':>10} {'-':>17}"
    rates = f"{r.bytes / t.median_us / 1e3:>7.2f} {r.flops / t.median_us / 1e3:>8.2f}" if t else f"{'-':>7} {'-':>8}"
    frac = r.roofline_fraction
    roof = f"{frac:>8.1%}" if frac is not None else f"{'-':>8}"
    status = "ok" if r.passed else "REJECTED"
    return f"{r.op:<20} {r.case:<16} {r.impl:<8} {status:<8} {timing} {rates} {roof}"


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"expected comma-separated integers, got {text!r}") from None
