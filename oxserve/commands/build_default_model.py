"""`oxserve build-default-model`: write the embedded random default model, or a variant of
its shape (`--set linear_head_dim=128`) for a study that needs one."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from oxserve.default_model import default_model_dir, ensure_default_model


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--out", type=Path, default=None, help=f"target directory (default: {default_model_dir()})")
    parser.add_argument("--force", action="store_true", help="rebuild even if it exists")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a text-config field of a variant (repeatable; VALUE is JSON, e.g. linear_head_dim=128); "
                        "needs --out")


def run(args: argparse.Namespace) -> int:
    overrides = dict(_override(text) for text in args.overrides)
    if overrides and args.out is None:
        raise SystemExit("--set builds a variant: give it its own --out directory")
    print(ensure_default_model(args.out, force=args.force, overrides=overrides))
    return 0


def _override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set takes KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        raise SystemExit(f"--set {key}: {value!r} is not a JSON value (numbers, true/false, null, \"strings\")") from None
