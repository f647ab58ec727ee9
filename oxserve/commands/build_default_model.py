"""`oxserve build-default-model`: write the embedded random default model."""

from __future__ import annotations

import argparse
from pathlib import Path

from oxserve.default_model import default_model_dir, ensure_default_model


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--out", type=Path, default=None, help=f"target directory (default: {default_model_dir()})")
    parser.add_argument("--force", action="store_true", help="rebuild even if it exists")


def run(args: argparse.Namespace) -> int:
    print(ensure_default_model(args.out, force=args.force))
    return 0
