"""`python -m oxserve.default_model [--out DIR] [--force]`: build the random-weight model, print its path."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import ensure_random_model, random_model_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m oxserve.default_model", description=__doc__)
    parser.add_argument("--out", type=Path, help=f"target directory (default: {random_model_dir()})")
    parser.add_argument("--force", action="store_true", help="rebuild even if the model is already there")
    args = parser.parse_args(argv)
    print(ensure_random_model(args.out, force=args.force))


if __name__ == "__main__":
    main()
