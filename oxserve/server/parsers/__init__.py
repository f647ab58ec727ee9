"""Chat outputs read back into OpenAI message fields: reasoning, content, tool calls.

    engine text --> reasoning parser --> reasoning_content
                          |
                          +--- content ---> tool-call parser --> content | tool_calls

The reasoning parser runs first (a tool call inside the reasoning is thinking, not a call)
and only its content goes on to the tool-call parser. `ChatOutputParser` does both for one
choice, on a whole text (`parse`) or delta by delta (`push`/`finish`, which return OpenAI
chat-chunk delta fragments in output order); the two read the same text the same way.

The parsers are looked up by the names of vLLM's `--tool-call-parser` and
`--reasoning-parser` flags in `TOOL_PARSERS` and `REASONING_PARSERS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from oxserve.server.parsers.glm_reasoning import (
    GlmReasoningParser,
    ReasoningStream,
    reasoning_ended,
)
from oxserve.server.parsers.glm_tools import (
    GlmToolParser,
    ParsedToolCalls,
    ToolCall,
    ToolCallStream,
    parse_tool_calls,
    tool_schema_index,
)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ChatOutput",
    "ChatOutputParser",
    "GlmReasoningParser",
    "GlmToolParser",
    "ParsedToolCalls",
    "ReasoningStream",
    "ToolCall",
    "ToolCallStream",
    "parse_tool_calls",
    "reasoning_ended",
    "reasoning_parser",
    "tool_parser",
    "tool_schema_index",
]

# name -> class taking the request's tools (OpenAI list) or the starts_in_reasoning flag
TOOL_PARSERS: dict[str, type[GlmToolParser]] = {"glm": GlmToolParser}
REASONING_PARSERS: dict[str, type[GlmReasoningParser]] = {"glm": GlmReasoningParser}

T = TypeVar("T")


def _lookup(registry: dict[str, T], name: str, kind: str) -> T:
    if name not in registry:
        raise ValueError(
            f"unknown {kind} parser {name!r}; known: {', '.join(sorted(registry))}"
        )
    return registry[name]


def tool_parser(name: str) -> type[GlmToolParser]:
    return _lookup(TOOL_PARSERS, name, "tool-call")


def reasoning_parser(name: str) -> type[GlmReasoningParser]:
    return _lookup(REASONING_PARSERS, name, "reasoning")


@dataclass
class ChatOutput:
    reasoning_content: str | None  # None without a reasoning block (or parser)
    content: str | None
    tool_calls: list[ToolCall]
    problems: list[str]  # what the tool-call parser could not make sense of, for logs


class ChatOutputParser:
    """One choice's output, read whole or delta by delta.

    reasoning: run the reasoning parser (else all text is content, <think> included);
    starts_in_reasoning: the rendered prompt ends with <think>;
    tools: the request's OpenAI tools, or None to read no tool calls (content verbatim).
    """

    def __init__(
        self,
        reasoning: bool,
        starts_in_reasoning: bool,
        tools: list[dict[str, Any]] | None,
        tool_parser_name: str = "glm",
        reasoning_parser_name: str = "glm",
    ):
        self._reasoning: GlmReasoningParser | None = None
        self._reasoning_stream: ReasoningStream | None = None
        if reasoning:
            self._reasoning = reasoning_parser(reasoning_parser_name)(
                starts_in_reasoning
            )
            self._reasoning_stream = self._reasoning.stream()
        self._tools: GlmToolParser | None = None
        self._tool_stream: ToolCallStream | None = None
        if tools is not None:
            self._tools = tool_parser(tool_parser_name)(tools)
            self._tool_stream = self._tools.stream()

    def parse(self, text: str) -> ChatOutput:
        reasoning, content = None, text or None
        if self._reasoning is not None:
            reasoning, content = self._reasoning.split(text)
        if self._tools is None:
            return ChatOutput(reasoning, content, [], [])
        calls = self._tools.parse(content or "")
        return ChatOutput(reasoning, calls.content, calls.tool_calls, calls.problems)

    def push(self, delta: str) -> list[dict[str, Any]]:
        if self._reasoning_stream is None:
            return self._through_tools([{"content": delta}] if delta else [])
        return self._through_tools(self._reasoning_stream.push(delta))

    def finish(self) -> list[dict[str, Any]]:
        pieces = self._reasoning_stream.finish() if self._reasoning_stream else []
        out = self._through_tools(pieces)
        return out + (self._tool_stream.finish() if self._tool_stream else [])

    @property
    def problems(self) -> list[str]:
        """What the stream's tool-call parser could not make sense of so far."""
        return list(self._tool_stream.problems) if self._tool_stream is not None else []

    def _through_tools(self, pieces: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self._tool_stream is None:
            return pieces
        out: list[dict[str, Any]] = []
        for piece in pieces:
            out += (
                self._tool_stream.push(piece["content"])
                if "content" in piece
                else [piece]
            )
        return out
