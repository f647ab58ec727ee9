"""`oxserve bench ceilings`: this machine's memory bandwidth and matmul rates, cached per machine."""

from __future__ import annotations

import argparse
import json

from oxserve.feedback.ceilings import format_ceilings_table, load_or_measure_ceilings


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--refresh", action="store_true", help="measure again instead of using the cached result")
    parser.add_argument("--quick", action="store_true", help="a ~1 s measurement instead of the full one")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    c = load_or_measure_ceilings(args.device, refresh=args.refresh, quick=args.quick)
    print(json.dumps(c.to_dict()) if args.json else format_ceilings_table(c))
    return 0
