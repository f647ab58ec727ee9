"""Incremental detokenization (streaming and stop strings read its text) against whole decodes."""

from __future__ import annotations

import random

from oxserve.default_model import default_model
from oxserve.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "def f(x):\n    return x  # naïve façade, 東京 and 🙂🙃 with\ttabs  and  spaces\n"


def streamed(tokenizer: Tokenizer, ids: list[int]) -> tuple[str, str]:
    detok = IncrementalDetokenizer(tokenizer)
    deltas = "".join(detok.push(token) for token in ids)
    return deltas, detok.text


def test_streamed_text_is_the_whole_decode_on_fresh_random_ids():
    tokenizer = Tokenizer(default_model())
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    for _ in range(300):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        whole = tokenizer.decode(ids)
        deltas, text = streamed(tokenizer, ids)
        assert deltas == text, f"seed {seed}: the deltas do not add up to the text"
        if whole.endswith("\ufffd"):  # an incomplete character at the end is held back
            assert whole.startswith(text), f"seed {seed}: {ids}"
        else:
            assert text == whole, f"seed {seed}: {ids}"


def test_multibyte_characters_split_over_tokens_come_out_whole():
    tokenizer = Tokenizer(default_model())
    rng = random.Random()
    for _ in range(50):
        start = rng.randrange(len(TEXT))
        piece = TEXT[start : start + rng.randrange(1, len(TEXT))]
        deltas, text = streamed(tokenizer, tokenizer.encode(piece))
        assert text == piece and deltas == piece
        assert "\ufffd" not in text
