"""Constraints -> llguidance grammars, checked before a request is queued.

llguidance (a Rust library, no runtime dependencies) computes the allowed-token mask
lazily per step; its grammars cover JSON Schema, regexes and Lark, so every constraint
kind compiles to one grammar string that a matcher then runs.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance as llg
from llguidance.gbnf_to_lark import any_to_lark
from tokenizers import Tokenizer

from oxserve.structured.params import StructuredOutputs

# Compact JSON: with flexible whitespace, a weak model can pad forever and never close.
JSON_OPTIONS = {"whitespace_flexible": False}
CACHE_SIZE = 256  # checked grammars kept, so n choices and repeated schemas check once


class GrammarCompiler:
    """Turns constraints into llguidance grammars for one tokenizer and vocabulary."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int):
        self._tokenizer_json, self.vocab_size, self.eos_token_id = tokenizer_json, vocab_size, eos_token_id
        self._tokenizer: llg.LLTokenizer | None = None
        self._checked: OrderedDict[StructuredOutputs, str] = OrderedDict()
        self._lock = threading.Lock()  # the server checks from worker threads

    @property
    def tokenizer(self) -> llg.LLTokenizer:
        """Built on first use (about a second for a 150k vocabulary), not at engine start."""
        with self._lock:
            if self._tokenizer is None:
                # The mask spans the model's vocabulary (it may exceed the tokenizer's): ids
                # with no token are never allowed. A finished grammar allows only EOS.
                self._tokenizer = _ll_tokenizer(self._tokenizer_json, self.vocab_size, self.eos_token_id)
            return self._tokenizer

    def grammar(self, constraint: StructuredOutputs) -> str:
        """The grammar for `constraint`, or ValueError saying why the engine cannot run it."""
        with self._lock:
            if (grammar := self._checked.get(constraint)) is not None:
                self._checked.move_to_end(constraint)
                return grammar
        try:
            grammar = _to_grammar(constraint)
        except ValueError:
            raise
        except Exception as e:  # llguidance's readers raise plain Exceptions for bad input (GBNF without a root)
            raise ValueError(f"the {constraint.kind} constraint does not parse: {e}") from None
        error = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"the {constraint.kind} constraint cannot be compiled: {error.strip()}")
        with self._lock:
            self._checked[constraint] = grammar
            if len(self._checked) > CACHE_SIZE:
                self._checked.popitem(last=False)
        return grammar

    def matcher(self, constraint: StructuredOutputs) -> llg.LLMatcher:
        matcher = llg.LLMatcher(self.tokenizer, self.grammar(constraint), log_level=0)
        if matcher.is_error():
            raise ValueError(f"the {constraint.kind} constraint cannot be compiled: {matcher.get_error()}")
        return matcher


def _ll_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_id: int) -> llg.LLTokenizer:
    """llguidance's view of the tokenizer. It takes every added token for a special one, which
    no grammar can write; tokens added as text (`"special": false`, such as GLM's <tool_call>)
    must match their text, or a JSON string could not hold "<think>" and a forced tool call
    could not write its own markup. Such a tokenizer is handed over token by token instead."""
    loaded = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_id)
    text_ids = {t["id"] for t in json.loads(tokenizer_json).get("added_tokens", []) if not t.get("special", True)}
    if not text_ids:
        return loaded
    wrapper = _TokenTable(loaded, text_ids, Tokenizer.from_str(tokenizer_json), eos_token_id)
    return llg.LLTokenizer(llg.TokenizerWrapper(wrapper), n_vocab=vocab_size, eos_token=eos_token_id)


class _TokenTable:
    """What llguidance.TokenizerWrapper reads: each token's bytes, the special ids, and encoding."""

    bos_token_id = None

    def __init__(self, loaded: llg.LLTokenizer, text_ids: set[int], tokenizer: Tokenizer, eos_token_id: int):
        self.eos_token_id = eos_token_id
        self.tokens = [loaded.decode_bytes([i]) for i in range(loaded.vocab_size)]
        self.special_token_ids = [i for i in range(loaded.vocab_size) if loaded.is_special_token(i) and i not in text_ids]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids


def check_constraint(compiler: GrammarCompiler | None, constraint: StructuredOutputs | None) -> None:
    """ValueError if `constraint` cannot run on the engine that has `compiler` (None: the
    checkpoint has no tokenizer)."""
    if constraint is None:
        return
    if compiler is None:
        raise ValueError("structured outputs need the checkpoint's tokenizer, and this one has none")
    compiler.grammar(constraint)


def _to_grammar(c: StructuredOutputs) -> str:
    if c.json is not None:
        try:
            schema = json.loads(c.json)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema is an object (or true/false)")
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if c.json_object:
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if c.regex is not None:
        return llg.LLMatcher.grammar_from_regex(c.regex)
    if c.choice is not None:
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(lark_literal(s) for s in c.choice))
    assert c.grammar is not None
    return llg.LLMatcher.grammar_from_lark(any_to_lark(c.grammar))


def lark_literal(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)
