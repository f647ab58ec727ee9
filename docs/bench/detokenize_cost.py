"""What incremental detokenization costs a token: the engine's `IncrementalDetokenizer`
(`tokenizers`' DecodeStream) against the same window algorithm in Python (two decodes and two
list slices a token, what the engine ran before), on the default model's corpus.

    python docs/bench/detokenize_cost.py [--tokens N]

Single runs, not an A/B; it also checks that both give the same text.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import oxserve.default_model
from oxserve.default_model import default_model
from oxserve.tokenizer import IncrementalDetokenizer, Tokenizer


def python_window(tokenizer: Tokenizer, ids: list[int]) -> str:
    """The window algorithm in Python: decode [prefix, read) and [prefix, end), emit the difference."""
    text, prefix_offset, read_offset, seen = "", 0, 0, []
    for token in ids:
        seen.append(token)
        prefix = tokenizer.decode(seen[prefix_offset:read_offset])
        full = tokenizer.decode(seen[prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            continue
        text += full[len(prefix):]
        prefix_offset, read_offset = read_offset, len(seen)
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=5000)
    args = parser.parse_args()
    tokenizer = Tokenizer(default_model())
    corpus = (Path(oxserve.default_model.__file__).parent / "corpus.txt").read_text()
    ids = tokenizer.encode(corpus[: 40 * args.tokens])[: args.tokens]
    start = time.perf_counter()
    reference = python_window(tokenizer, ids)
    python_us = (time.perf_counter() - start) / len(ids) * 1e6
    start = time.perf_counter()
    detok = IncrementalDetokenizer(tokenizer)
    for token in ids:
        detok.push(token)
    engine_us = (time.perf_counter() - start) / len(ids) * 1e6
    print(f"{len(ids)} tokens: engine {engine_us:.2f} us a token, Python window {python_us:.2f} us; "
          f"same text: {detok.text == reference}")


if __name__ == "__main__":
    main()
