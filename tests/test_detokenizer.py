"""Incremental detokenization (streaming and stop strings read its text) against whole decodes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from oxserve.default_model import default_model
from oxserve.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "def f(x):\n    return x  # naïve façade, 東京 and 🙂🙃 with\ttabs  and  spaces\n"


@pytest.fixture
def rng() -> random.Random:
    seed = random.randrange(2**32)
    print(f"seed {seed}")  # shown with a failure
    return random.Random(seed)


def streamed(tokenizer: Tokenizer, ids: list[int]) -> tuple[str, str]:
    detok = IncrementalDetokenizer(tokenizer)
    deltas = "".join(detok.push(token) for token in ids)
    return deltas, detok.text


def test_streamed_text_is_the_whole_decode_on_fresh_random_ids(rng):
    tokenizer = Tokenizer(default_model())
    for _ in range(300):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        whole = tokenizer.decode(ids)
        deltas, text = streamed(tokenizer, ids)
        assert deltas == text, "the deltas do not add up to the text"
        if whole.endswith("\ufffd"):  # an incomplete character at the end is held back
            assert whole.startswith(text), ids
        else:
            assert text == whole, ids


def test_multibyte_characters_split_over_tokens_come_out_whole(rng):
    tokenizer = Tokenizer(default_model())
    for _ in range(50):
        start = rng.randrange(len(TEXT))
        piece = TEXT[start : start + rng.randrange(1, len(TEXT))]
        ids = tokenizer.encode(piece)
        detok = IncrementalDetokenizer(tokenizer)
        for i, token in enumerate(ids):  # nothing is held back but an incomplete character
            detok.push(token)
            so_far = tokenizer.decode(ids[: i + 1])
            if so_far.endswith("\ufffd"):
                assert so_far.startswith(detok.text), piece
            else:
                assert detok.text == so_far, piece
        assert detok.text == piece and "\ufffd" not in detok.text


def byte_fallback_tokenizer(path: Path) -> tuple[Tokenizer, dict[str, int]]:
    """A Llama-style tokenizer: unknown text falls back to byte tokens <0x00>..<0xFF>."""
    vocab = {"<unk>": 0, "a": 1, "b": 2}
    vocab.update({f"<0x{byte:02X}>": 3 + byte for byte in range(256)})
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    hf.save(str(path / "tokenizer.json"))
    return Tokenizer(path), vocab


def test_byte_fallback_bytes_that_never_form_a_character_do_not_raise(tmp_path, rng):
    """Bytes that never form a character make the window's text stop being a prefix of itself
    (' ' then '\\ufffd\\ufffda'): the detokenizer goes on instead of failing the engine's step."""
    tokenizer, vocab = byte_fallback_tokenizer(tmp_path)
    detok = IncrementalDetokenizer(tokenizer)
    for token in (vocab["<0x20>"], vocab["<0xFF>"], vocab["a"], vocab["b"]):
        detok.push(token)
    assert detok.text.startswith(" ") and detok.text.endswith("ab")
    for _ in range(200):  # valid UTF-8 spelled in byte tokens comes out whole
        piece = "".join(rng.choice("ab né東🙂") for _ in range(rng.randrange(1, 12)))
        ids = []
        for ch in piece:
            ids += [vocab[ch]] if ch in vocab else [vocab[f"<0x{b:02X}>"] for b in ch.encode()]
        _, text = streamed(tokenizer, ids)
        assert text == piece, piece
