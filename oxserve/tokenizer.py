"""Tokenizer from a checkpoint's `tokenizer.json` (the `tokenizers` library, no transformers),
its chat template (jinja2) and incremental detokenization for streaming and stop strings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

# Tokens that open a chat turn (GLM's, and ChatML's): a prompt's position before one is a
# conversation boundary, where prefix caching saves state.
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|im_start|>")


class Tokenizer:
    def __init__(self, path: Path):
        self._tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        config_path = path / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        if self.chat_template is None and (path / "chat_template.jinja").exists():
            self.chat_template = (path / "chat_template.jinja").read_text()
        self.eos_token_id = self._special_id("eos_token")

    @staticmethod
    def from_dir(path: str | Path) -> "Tokenizer | None":
        path = Path(path)
        return Tokenizer(path) if (path / "tokenizer.json").exists() else None

    def _special_id(self, key: str) -> int | None:
        token = self.config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        return self._tok.token_to_id(token) if token else None

    def role_token_ids(self) -> frozenset[int]:
        return frozenset(i for t in ROLE_TOKENS if (i := self._tok.token_to_id(t)) is not None)

    def to_json(self) -> str:
        """The `tokenizers` serialisation (what grammar engines build their vocabulary from)."""
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.chat_template:
            raise ValueError("this checkpoint has no chat template; send a plain prompt instead")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        template = env.from_string(self.chat_template)
        specials = {k: self.config.get(k) for k in ("bos_token", "eos_token", "pad_token")}
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **specials, **kwargs)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    """transformers' `tojson` (keys in their order, unicode kept), so templates render as HF renders them."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise ValueError(message)


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into text deltas without re-decoding everything.

    `tokenizers`' DecodeStream: it decodes a short window of already-emitted tokens with and
    without the new one, so that multi-token characters and merged spaces come out right, and
    holds back a delta ending in U+FFFD (an incomplete UTF-8 sequence) until a later token
    completes it. One call into Rust a token, where the same window in Python took two
    decodes and two list slices (`python docs/bench/detokenize_cost.py` times both).
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer._tok
        self._stream = DecodeStream(skip_special_tokens=True)  # as `Tokenizer.decode`
        self.text = ""

    def push(self, token_id: int) -> str:
        try:
            delta = self._stream.step(self._tok, token_id)
        except Exception:  # noqa: BLE001 -- its "invalid prefix": see below
            # A byte-fallback decoder turns bytes that never form a character into U+FFFD
            # once later bytes arrive, so the window's text stops being a prefix of itself:
            # the window restarts at this token (the text so far stands, the stray bytes are
            # dropped) rather than failing the step of every request.
            self._stream = DecodeStream(skip_special_tokens=True)
            delta = self._stream.step(self._tok, token_id)
        if not delta:
            return ""
        self.text += delta
        return delta
