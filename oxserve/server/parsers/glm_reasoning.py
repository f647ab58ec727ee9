"""GLM reasoning, `<think>...</think>`, read out of a chat output as `reasoning_content`.

GLM's chat template ends the generation prompt with `<|assistant|><think>` when thinking
is on, so the output starts inside the reasoning and has no `<think>` of its own, and with
`<|assistant|></think>` when it is off, so the output is all content. Older models write
`<think>` themselves first. Hence `starts_in_reasoning`, which the server sets when the
rendered prompt ends with `<think>`; without it, an output that begins (after optional
whitespace) with `<think>` opens the block itself, and any other output is all content.

Where the format leaves room:
  - the reasoning is the text up to the first `</think>`, verbatim; an output that never
    closes the block (cut at max_tokens) is all reasoning, and content None.
  - content after `</think>` loses its leading newlines (GLM writes `</think>\\n`); None
    when nothing is left. Later `<think>`/`</think>` text is content, verbatim.
  - `reasoning_content` is None only when there was no block; an empty block gives "".

`ReasoningStream` holds back what may be a `</think>` (or, at the start, `<think>`) cut
between deltas, so no text is ever sent in the wrong field.
"""

from __future__ import annotations

import enum
from typing import Any

THINK, THINK_END = "<think>", "</think>"


def reasoning_ended(text: str) -> bool:
    """Whether an output that started in reasoning has closed it (`</think>` produced)."""
    return THINK_END in text


class GlmReasoningParser:
    """The `--reasoning-parser glm` entry: one request's outputs, read whole or streamed."""

    def __init__(self, starts_in_reasoning: bool):
        self.starts_in_reasoning = starts_in_reasoning

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output."""
        if not self.starts_in_reasoning:
            head = text.lstrip()
            if not head.startswith(THINK):
                return None, text or None
            text = head[len(THINK) :]
        reasoning, closed, content = text.partition(THINK_END)
        return reasoning, (content.lstrip("\n") or None) if closed else None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.starts_in_reasoning)


class _S(enum.Enum):
    START = "start"  # not yet known whether the output opens a block
    REASONING = "reasoning"
    LEAD = "lead"  # just after </think>: newlines to drop
    CONTENT = "content"


class ReasoningStream:
    """Reads one output delta by delta; `push` and `finish` return delta fragments, at
    most one {"reasoning_content"} then one {"content"} each."""

    def __init__(self, starts_in_reasoning: bool):
        self._state = _S.REASONING if starts_in_reasoning else _S.START
        self._buf = ""  # undecided text

    def push(self, delta: str) -> list[dict[str, Any]]:
        self._buf += delta
        reasoning = content = ""
        if self._state is _S.START:
            head = self._buf.lstrip()
            if head.startswith(THINK):
                self._state, self._buf = _S.REASONING, head[len(THINK) :]
            elif THINK.startswith(head):  # whitespace, or a <think> cut short
                return []
            else:
                self._state = _S.CONTENT
        if self._state is _S.REASONING:
            reasoning, closed, rest = self._buf.partition(THINK_END)
            if closed:
                self._state, self._buf = _S.LEAD, rest
            else:
                cut = len(reasoning) - _partial(reasoning, THINK_END)
                reasoning, self._buf = reasoning[:cut], reasoning[cut:]
        if self._state is _S.LEAD:
            self._buf = self._buf.lstrip("\n")
            if self._buf:
                self._state = _S.CONTENT
        if self._state is _S.CONTENT:
            content, self._buf = self._buf, ""
        return _fragments(reasoning, content)

    def finish(self) -> list[dict[str, Any]]:
        """The end of the output: text held back goes to the field it was in."""
        rest, self._buf = self._buf, ""
        if self._state is _S.REASONING:
            return _fragments(rest, "")
        return _fragments("", rest if self._state in (_S.START, _S.CONTENT) else "")


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag` (whose only `<`
    is its first character)."""
    tail = text[text.rfind("<") :] if "<" in text else ""
    return len(tail) if tail and tag.startswith(tail) else 0


def _fragments(reasoning: str, content: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if reasoning:
        out.append({"reasoning_content": reasoning})
    if content:
        out.append({"content": content})
    return out
