"""How a chat request's output is constrained and read back: tools, tool_choice, reasoning.

    request ----- tool_choice required / named -> a grammar forcing GLM tool-call markup
       |          response_format / guided_*  -> the request's own constraint
       |          (either starts after </think> when the prompt opened a reasoning block)
       v
    engine text -- ChatOutputParser --> reasoning_content | content | tool_calls
                    (whole text for a response; delta by delta for a stream)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from oxserve.outputs import CompletionOutput
from oxserve.sampling_params import SamplingParams
from oxserve.server.parsers import REASONING_PARSERS, TOOL_PARSERS, ChatOutputParser
from oxserve.server.protocol import ChatCompletionRequest, bad_request
from oxserve.server.tool_grammar import tool_call_grammar
from oxserve.structured import StructuredOutputs
from oxserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)

REASONING_OPEN, REASONING_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ChatParsing:
    """The server's options for reading chat outputs (vLLM's flag names)."""

    tool_call_parser: str | None = None  # --tool-call-parser
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    reasoning_parser: str | None = None  # --reasoning-parser

    def __post_init__(self) -> None:
        for name, known in ((self.tool_call_parser, TOOL_PARSERS), (self.reasoning_parser, REASONING_PARSERS)):
            if name is not None and name not in known:
                raise ValueError(f"unknown parser {name!r}; known: {', '.join(sorted(known))}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


class ChatTurn:
    """One chat request's reading rules, fixed once its prompt is rendered."""

    def __init__(self, req: ChatCompletionRequest, parsing: ChatParsing, prompt: str, tokenizer: Tokenizer | None):
        self.req = req
        choice = req.effective_tool_choice
        self.forced = req.forced_tools()
        if req.tools and choice != "none" and parsing.tool_call_parser is None:
            raise bad_request("tool calls need the server to run with --tool-call-parser", "tools")
        if choice == "auto" and req.tools and not parsing.enable_auto_tool_choice:
            raise bad_request('"auto" tool choice needs the server to run with --enable-auto-tool-choice', "tool_choice")
        self.tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and choice != "none" else None
        self.reasoning = parsing.reasoning_parser is not None
        self.starts_in_reasoning = self.reasoning and prompt.endswith(REASONING_OPEN)
        self.reasoning_end = _single_token(tokenizer, REASONING_CLOSE) if self.starts_in_reasoning else None

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """`params` with the turn's constraint: a forced tool call, or the request's own;
        after the reasoning block when the output starts inside one."""
        constraint = params.structured_outputs
        if self.forced is not None:
            if constraint is not None:
                raise bad_request("a forced tool call cannot be combined with another output constraint", "tool_choice")
            try:
                constraint = StructuredOutputs(grammar=tool_call_grammar(self.forced, self.req.parallel_tool_calls))
            except ValueError as e:
                raise bad_request(f"cannot force a call to these tools: {e}", "tools") from None
        if constraint is not None and self.reasoning_end is not None:
            constraint = replace(constraint, after_token_id=self.reasoning_end)
        return replace(params, structured_outputs=constraint)

    def parser(self) -> ChatOutputParser:
        return ChatOutputParser(reasoning=self.reasoning, starts_in_reasoning=self.starts_in_reasoning, tools=self.tools)

    def message(self, c: CompletionOutput) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a finished choice, and its finish reason."""
        out = self.parser().parse(c.text)
        for problem in out.problems:
            log.warning("tool call output not understood: %s", problem)
        message: dict[str, Any] = {"role": "assistant", "content": out.content}
        if self.reasoning:
            message["reasoning_content"] = out.reasoning_content
        if out.tool_calls:
            message["tool_calls"] = [call.openai() for call in out.tool_calls]
        return message, self.finish_reason(c, bool(out.tool_calls))

    @staticmethod
    def finish_reason(c: CompletionOutput, called: bool) -> str | None:
        # OpenAI: a turn that ends by calling tools finishes with "tool_calls".
        return "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason


def _single_token(tokenizer: Tokenizer | None, text: str) -> int | None:
    ids = tokenizer.encode(text) if tokenizer is not None else []
    return ids[0] if len(ids) == 1 else None
