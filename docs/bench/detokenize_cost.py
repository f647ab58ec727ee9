"""What incremental detokenization costs a token: the engine's `IncrementalDetokenizer`
(`tokenizers`' DecodeStream) against the same window algorithm in Python (two decodes and two
list slices a token, what the engine ran before), on the default model's corpus.

    python docs/bench/detokenize_cost.py [--tokens N]

The engine's text is read after every token, as each decode step's output reads it.

Single runs, not an A/B; it also checks that both give the same text.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import oxserve.default_model
from oxserve.default_model import default_model
from oxserve.tokenizer import IncrementalDetokenizer, Tokenizer


class PythonWindow:
    """The window algorithm in Python, as the engine ran it before: decode [prefix, read) and
    [prefix, end), emit the difference, append it to the text."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.text, self.prefix_offset, self.read_offset, self.ids = tokenizer, "", 0, 0, []

    def push(self, token: int) -> str:
        self.ids.append(token)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


def per_token_us(detok, ids: list[int]) -> float:
    start = time.perf_counter()
    for token in ids:
        detok.push(token)
        detok.text  # read each token, as a decode step's output reads it  # noqa: B018
    return (time.perf_counter() - start) / len(ids) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=5000)
    args = parser.parse_args()
    tokenizer = Tokenizer(default_model())
    corpus = (Path(oxserve.default_model.__file__).parent / "corpus.txt").read_text()
    ids = tokenizer.encode(corpus[: 40 * args.tokens])[: args.tokens]
    reference, detok = PythonWindow(tokenizer), IncrementalDetokenizer(tokenizer)
    python_us, engine_us = per_token_us(reference, ids), per_token_us(detok, ids)
    print(f"{len(ids)} tokens: engine {engine_us:.2f} us a token, Python window {python_us:.2f} us; "
          f"same text: {detok.text == reference.text}")


if __name__ == "__main__":
    main()
