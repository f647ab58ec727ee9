"""`oxserve build-default-model`: write a random-weight model of the default family, or a
variant of its shape (`--set linear_head_dim=128`) for a study that needs one; with `--train`,
train the default model from scratch (what `oxserve/default_model/trained/` holds)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from oxserve.default_model import ensure_random_model, random_model_dir
from oxserve.default_model.train import TrainSettings, train


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--out", type=Path, default=None, help=f"target directory (default: {random_model_dir()})")
    parser.add_argument("--force", action="store_true", help="rebuild even if it exists")
    parser.epilog = "The default model itself is trained and shipped (oxserve/default_model/trained); this builds others."
    parser.add_argument("--train", action="store_true",
                        help="train the default model on the Python standard library's source (MTP layer included; "
                        "about 45 minutes on 2 cores; needs --out)")
    parser.add_argument("--steps", type=int, default=TrainSettings.steps, help="--train: optimizer steps")
    parser.add_argument("--threads", type=int, default=TrainSettings.threads, help="--train: intra-op threads")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a text-config field of a variant (repeatable; VALUE is JSON, e.g. linear_head_dim=128); "
                        "needs --out")


def run(args: argparse.Namespace) -> int:
    if args.train:
        if args.out is None or args.overrides:
            raise SystemExit("--train writes the default model's shape: give it --out DIR, and no --set")
        print(train(args.out, TrainSettings(steps=args.steps, threads=args.threads), log=lambda line: print(line, flush=True)))
        return 0
    overrides = dict(_override(text) for text in args.overrides)
    if overrides and args.out is None:
        raise SystemExit("--set builds a variant: give it its own --out directory")
    print(ensure_random_model(args.out, force=args.force, overrides=overrides))
    return 0


def _override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set takes KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        raise SystemExit(f"--set {key}: {value!r} is not a JSON value (numbers, true/false, null, \"strings\")") from None
