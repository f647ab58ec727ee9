"""GLM tool calls, read out of a chat output as OpenAI `tool_calls`.

GLM-4.5 and later write a call as

    <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>

with optional whitespace between the elements (GLM-4.5 puts a newline after the name and
after each argument). Each tag is one token of the tokenizer but reaches us as text.

A value is written as text, not JSON, so the tool's parameter schema decides how it is
read: for a `string` parameter (or one the schema does not describe, or of an unknown
tool) it is the string, verbatim; for any other type it is parsed as JSON (or as Python's
True/False/None where the schema allows boolean/null), and kept as the string, with a
problem noted, when it does not parse. `arguments` is `json.dumps(args, ensure_ascii=False)`.

One state machine, `ToolCallStream`, reads both streams and whole texts: `parse_tool_calls`
is the stream fed the text as one delta, so the two cannot disagree. The stream sends
  - content as it comes, holding back what may be the start of `<tool_call>` and any
    trailing whitespace (which a following call would strip), so nothing is retracted;
  - a call's id and name as soon as the name is complete (at the first tag after it);
  - its arguments in pieces of the final JSON string: a string value as it is written,
    any other value once its `</arg_value>` is seen, the closing `}` at `</tool_call>`.

Where the format leaves room:
  - content is the text before the first call, its trailing whitespace stripped, None if
    nothing is left (all of the text, verbatim, when there is no call). Text after the
    first call begins, between and after calls, is dropped, as vLLM does.
  - nothing raises: a malformed call is read as far as it makes sense and each oddity is
    a `problems` entry (unknown function, a value that is not the JSON its schema wants,
    an `<arg_key>` without its `<arg_value>`, an unclosed element, stray text or tags).
  - an unterminated call (output cut at max_tokens): once its name is complete it has been
    streamed, so it stays, with the arguments complete by then (a string value cut short
    keeps what was written; any other cut value is dropped) and its JSON closed. A call
    cut before its name is complete is dropped, as is one without a name.
  - a repeated argument keeps its first value.
"""

from __future__ import annotations

import enum
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
ARG_KEY, ARG_KEY_END = "<arg_key>", "</arg_key>"
ARG_VALUE, ARG_VALUE_END = "<arg_value>", "</arg_value>"
CALL_TAGS = (TOOL_CALL, TOOL_CALL_END, ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END)
OUTSIDE_TAGS = (TOOL_CALL,)  # outside a call, the other tags are plain text

Schema = dict[str, Any]


def tool_schema_index(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """{function name: {parameter: its JSON schema}} from an OpenAI `tools` list (bare
    function objects, as `tool_grammar` takes, work too)."""
    index: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            index[fn["name"]] = {k: resolved(v, params) for k, v in props.items()} if isinstance(props, dict) else {}
    return index


def resolved(schema: Any, root: dict[str, Any]) -> Any:
    """A parameter's schema with its own `$ref` into the root's `$defs` / `definitions`
    followed (as Pydantic writes nested models), so its type is known; refs within stay."""
    for _ in range(8):  # a chain of refs, not a cycle
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        section, _, name = ref.removeprefix("#/").partition("/") if isinstance(ref, str) else ("", "", "")
        target = root.get(section, {}).get(name) if section in ("$defs", "definitions") and isinstance(root.get(section), dict) else None
        if target is None:
            return schema
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def schema_types(schema: Any) -> set[str]:
    """The JSON types a schema admits; empty when it does not say (then any, strings too)."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    for union in ("anyOf", "oneOf"):
        if isinstance(schema.get(union), list):
            branches = [schema_types(s) for s in schema[union]]
            # an untyped branch admits strings, so the union does too
            return set().union(*branches) if all(branches) else set()
    values = schema["enum"] if isinstance(schema.get("enum"), list) else None
    if values is None and "const" in schema:
        values = [schema["const"]]
    if values:
        return {
            _JSON_TYPES.get(type(v), "null" if v is None else "object") for v in values
        }
    return set()


_LITERALS = {
    "True": (True, "boolean"),
    "False": (False, "boolean"),
    "None": (None, "null"),
}


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def read_value(raw: str, schema: Any) -> tuple[Any, str | None]:
    """A value as its schema types it, and what was wrong with it (None when nothing)."""
    types = schema_types(schema)
    if not types or "string" in types:
        return raw, None
    try:
        return json.loads(raw, parse_constant=_not_json), None
    except ValueError:
        pass
    literal = _LITERALS.get(raw.strip())
    if literal is not None and literal[1] in types:
        return literal[0], None
    return raw, f"{raw!r} is not JSON ({'/'.join(sorted(types))}); kept as a string"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON object text, as OpenAI sends it

    def openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass
class ParsedToolCalls:
    content: str | None
    tool_calls: list[ToolCall]
    problems: list[str]


class _S(enum.Enum):
    CONTENT = "content"  # before the first call
    AFTER = "after"  # after a call began: text is dropped until the next call
    NAME = "name"
    ARGS = "args"  # between arguments
    KEY = "key"
    KEYED = "keyed"  # after </arg_key>, before <arg_value>
    VALUE = "value"
    SKIP = "skip"  # a call without a name, dropped up to its </tool_call>


_IN_CALL = {_S.NAME, _S.ARGS, _S.KEY, _S.KEYED, _S.VALUE, _S.SKIP}


@dataclass
class _Call:
    index: int
    id: str
    name: str
    params: dict[str, Any] | None  # None: an unknown function
    pieces: list[str] = field(default_factory=list)  # of the arguments JSON, as sent
    keys: set[str] = field(default_factory=set)
    strays: bool = False


def _first_tag(text: str, tags: tuple[str, ...]) -> tuple[int, str | None]:
    found = [(i, t) for t in tags if (i := text.find(t)) >= 0]
    return min(found) if found else (-1, None)


def _partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may be the start of one of `tags`. Each
    tag has its only `<` first, so only the text from the last `<` can be one."""
    tail = text[text.rfind("<") :] if "<" in text else ""
    return len(tail) if tail and any(t.startswith(tail) for t in tags) else 0


class ToolCallStream:
    """Reads one output delta by delta; `push` and `finish` return OpenAI chat-chunk delta
    fragments ({"content"} or {"tool_calls": [one call's announcement or arguments]}),
    adjacent pieces of the same field merged. `result()` is what was read so far."""

    def __init__(self, tools: list[dict[str, Any]] | None):
        self.schemas = tool_schema_index(tools)
        self.problems: list[str] = []
        self.calls: list[_Call] = []
        self._content: list[str] = []
        self._state = _S.CONTENT
        self._buf = ""  # undecided text: it may be the start of a tag
        self._text = ""  # the element being read: a name, a key, a non-string value
        # content's trailing whitespace, sent once more content follows
        self._space = ""
        self._call: _Call | None = None
        self._key: str | None = None  # the value being read; None when it is ignored
        self._string = False  # whether that value is a string, streamed as written
        self._dropped = 0  # non-space characters dropped after the calls began
        self._out: list[dict[str, Any]] = []

    def push(self, delta: str) -> list[dict[str, Any]]:
        self._buf += delta
        while True:
            tags = CALL_TAGS if self._state in _IN_CALL else OUTSIDE_TAGS
            at, tag = _first_tag(self._buf, tags)
            if tag is None:
                safe = len(self._buf) - _partial_tag(self._buf, tags)
                self._on_text(self._buf[:safe])
                self._buf = self._buf[safe:]
                return self._flush()
            self._on_text(self._buf[:at])
            self._buf = self._buf[at + len(tag) :]
            while not self._take(tag):
                pass

    def finish(self) -> list[dict[str, Any]]:
        """The end of the output: what was held back, and any call left open, closed."""
        rest, self._buf = self._buf, ""
        self._on_text(rest)  # a tag cut short is text
        state = self._state
        if state is _S.CONTENT and self._space:
            self._emit_content(self._space)
        elif state is _S.NAME:
            name = self._text.strip()
            self._problem(
                f"<tool_call>{name} was cut short before its name was complete; dropped"
            )
        elif state in _IN_CALL:
            if state is _S.VALUE and self._key is not None and not self._string:
                self._call_problem(f"the value of {self._key!r} was cut short; dropped")
                self._key = None
            self._end_call(closed=False)
        if self._dropped:
            self._problem(
                f"{self._dropped} non-space characters after a tool call were dropped"
            )
        self._state, self._space, self._dropped = _S.AFTER, "", 0
        return self._flush()

    def result(self) -> ParsedToolCalls:
        calls = [ToolCall(c.id, c.name, "".join(c.pieces)) for c in self.calls]
        return ParsedToolCalls(
            "".join(self._content) or None, calls, list(self.problems)
        )

    # ---- reading ----------------------------------------------------------------------
    def _on_text(self, text: str) -> None:
        if not text:
            return
        state = self._state
        if state is _S.CONTENT:
            text = self._space + text
            body = text.rstrip()
            self._space = text[len(body) :]
            if body:
                self._emit_content(body)
        elif state is _S.AFTER:
            self._dropped += sum(not c.isspace() for c in text)
        elif state in (_S.NAME, _S.KEY):
            self._text += text
        elif state is _S.VALUE:
            if self._key is None:
                pass
            elif self._string:
                # JSON escapes character by character, so the pieces concatenate
                self._emit_args(json.dumps(text, ensure_ascii=False)[1:-1])
            else:
                self._text += text
        elif state in (_S.ARGS, _S.KEYED) and text.strip():
            assert self._call is not None
            if not self._call.strays:
                self._call.strays = True
                self._call_problem("stray text between arguments ignored")

    def _take(self, tag: str) -> bool:
        """Act on a tag; False when the state changed and the tag is to be read again."""
        state = self._state
        if state in (_S.CONTENT, _S.AFTER):  # only <tool_call> is a tag here
            self._space = ""  # content before a call does not end in whitespace
            self._state, self._text = _S.NAME, ""
            return True
        if tag == TOOL_CALL:
            # a call begins inside a call: the first one was not closed
            self._end_call(closed=False)
            return False
        if state is _S.SKIP:
            if tag == TOOL_CALL_END:
                self._state = _S.AFTER
            return True
        if state is _S.NAME:
            self._end_name()
            return False
        if state is _S.KEY:
            if tag == ARG_KEY_END:
                self._state = _S.KEYED
                return True
            self._call_problem(f"<arg_key>{self._text.strip()} is not closed; dropped")
            self._state = _S.ARGS
            return False
        if state is _S.KEYED:
            if tag == ARG_VALUE:
                self._start_value(self._text.strip())
                return True
            self._call_problem(
                f"argument {self._text.strip()!r} has no <arg_value>; dropped"
            )
            self._state = _S.ARGS
            return False
        if state is _S.VALUE:
            self._end_value(closed=tag == ARG_VALUE_END)
            return tag == ARG_VALUE_END
        # between arguments
        if tag == ARG_KEY:
            self._state, self._text = _S.KEY, ""
        elif tag == TOOL_CALL_END:
            self._end_call(closed=True)
        elif tag == ARG_VALUE:
            self._call_problem("<arg_value> without an <arg_key>; ignored")
            self._start_value(None)
        else:
            self._call_problem(f"stray {tag} ignored")
        return True

    def _end_name(self) -> None:
        name, self._text = self._text.strip(), ""
        if not name:
            self._problem("a <tool_call> without a function name was dropped")
            self._state = _S.SKIP
            return
        params = self.schemas.get(name)
        call = _Call(len(self.calls), f"call_{secrets.token_hex(12)}", name, params)
        self.calls.append(call)
        self._call, self._state = call, _S.ARGS
        if params is None:
            known = ", ".join(sorted(self.schemas)) or "none"
            self._call_problem(f"unknown function (known: {known})")
        function = {"name": name, "arguments": ""}
        fragment = {
            "index": call.index,
            "id": call.id,
            "type": "function",
            "function": function,
        }
        self._out.append({"tool_calls": [fragment]})

    def _start_value(self, key: str | None) -> None:
        call = self._call
        assert call is not None
        self._state, self._text, self._key = _S.VALUE, "", None
        if key is None:
            return
        if not key:
            self._call_problem("an argument with an empty name was dropped")
        elif key in call.keys:
            self._call_problem(f"argument {key!r} is repeated; the first value is kept")
        else:
            call.keys.add(key)
            self._key = key
            types = schema_types((call.params or {}).get(key))
            self._string = not types or "string" in types
            if self._string:
                self._emit_args(self._arg_head(key) + '"')

    def _end_value(self, closed: bool) -> None:
        key, self._key, self._state = self._key, None, _S.ARGS
        if key is None:
            return
        if not closed:
            self._call_problem(f"<arg_value> of {key!r} is not closed")
        if self._string:
            self._emit_args('"')
            return
        assert self._call is not None
        value, problem = read_value(self._text, (self._call.params or {}).get(key))
        if problem is not None:
            self._call_problem(f"argument {key!r}: {problem}")
        self._emit_args(self._arg_head(key) + json.dumps(value, ensure_ascii=False))

    def _end_call(self, closed: bool) -> None:
        """Close the current call, whatever element it was in."""
        state = self._state
        if state is _S.NAME:
            self._end_name()
            state = self._state
        if state is _S.SKIP:
            self._state = _S.AFTER
            return
        if state is _S.KEY:
            self._call_problem(f"<arg_key>{self._text.strip()} is not closed; dropped")
        elif state is _S.KEYED:
            self._call_problem(
                f"argument {self._text.strip()!r} has no <arg_value>; dropped"
            )
        elif state is _S.VALUE:
            self._end_value(closed=False)
        call = self._call
        assert call is not None
        self._emit_args("}" if call.pieces else "{}")
        if not closed:
            self._call_problem("not closed by </tool_call> (output cut short?)")
        self._call, self._state = None, _S.AFTER

    def _arg_head(self, key: str) -> str:
        assert self._call is not None
        return (
            ("{" if not self._call.pieces else ", ")
            + json.dumps(key, ensure_ascii=False)
            + ": "
        )

    # ---- output -----------------------------------------------------------------------
    def _emit_content(self, text: str) -> None:
        self._content.append(text)
        if self._out and "content" in self._out[-1]:
            self._out[-1]["content"] += text
        else:
            self._out.append({"content": text})

    def _emit_args(self, piece: str) -> None:
        call = self._call
        assert call is not None
        call.pieces.append(piece)
        last = (
            self._out[-1]["tool_calls"][0]
            if self._out and "tool_calls" in self._out[-1]
            else None
        )
        if last is not None and last["index"] == call.index:
            last["function"]["arguments"] += piece
        else:
            self._out.append(
                {
                    "tool_calls": [
                        {"index": call.index, "function": {"arguments": piece}}
                    ]
                }
            )

    def _flush(self) -> list[dict[str, Any]]:
        out, self._out = self._out, []
        return out

    def _problem(self, text: str) -> None:
        self.problems.append(text)

    def _call_problem(self, text: str) -> None:
        name = self._call.name if self._call is not None else "?"
        self._problem(f"tool call {name!r}: {text}")


def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None) -> ParsedToolCalls:
    """A whole output's content and tool calls (the stream, fed it in one delta)."""
    stream = ToolCallStream(tools)
    stream.push(text)
    stream.finish()
    return stream.result()


class GlmToolParser:
    """The `--tool-call-parser glm` entry: one request's tools, read whole or streamed."""

    def __init__(self, tools: list[dict[str, Any]] | None):
        self.tools = tools

    def parse(self, text: str) -> ParsedToolCalls:
        return parse_tool_calls(text, self.tools)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.tools)
