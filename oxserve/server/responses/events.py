"""A response's generation: engine outputs -> chat parser pieces -> output items and events.

    response.created, response.in_progress
    per item:  response.output_item.added
               reasoning / message: content_part.added, {reasoning_text|output_text}.delta..., .done, content_part.done
               function_call:       function_call_arguments.delta..., .done
               response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

Streamed or not, every response is made this way (a non-streamed one just isn't read until
it is done), so both give the same output. A cancelled response ends without a final event.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from oxserve.engine.output_text import TextDeltas
from oxserve.outputs import CompletionOutput
from oxserve.server.async_engine import EngineError, RequestGroup
from oxserve.server.chat_turn import ChatTurn
from oxserve.server.responses.store import ResponseRecord
from oxserve.server.serving import Job

log = logging.getLogger(__name__)

# kind of text piece -> (its item's type, its part's type, its events' prefix)
TEXT_KINDS = {
    "reasoning_content": ("reasoning", "reasoning_text", "response.reasoning_text"),
    "content": ("message", "output_text", "response.output_text"),
}


class OutputItems:
    """The output items of one response as its text arrives; each change is an event."""

    def __init__(self, record: ResponseRecord, job: Job, turn: ChatTurn):
        self.record, self.job, self.turn = record, job, turn
        self.parser = turn.parser()
        self.deltas = TextDeltas(job.params)
        self.open: dict[str, Any] | None = None  # the item being written; items before it are done
        self.calls: dict[int, dict[str, Any]] = {}  # the parser's tool call index -> its function_call item
        self.positions: dict[str, int] = {}  # item id -> its output_index
        self.last: CompletionOutput | None = None

    def push(self, c: CompletionOutput) -> None:
        self.last = c
        text, _, _ = self.deltas.next(c.text, c.token_ids, c.logprobs, c.finished)
        self._apply((self.parser.push(text) if text else []) + (self.parser.finish() if c.finished else []))

    def flush(self) -> None:
        """Cut short (cancelled, failed): what the parser still holds back (a possible start of
        a tool call, trailing whitespace) is output too."""
        if self.last is None or not self.last.finished:
            self._apply(self.parser.finish())

    def _apply(self, pieces: list[dict[str, Any]]) -> None:
        for piece in pieces:
            for kind in TEXT_KINDS:
                if piece.get(kind):
                    self._text(kind, piece[kind])
            for call in piece.get("tool_calls", []):
                self._call(call)

    def close(self, status: str) -> None:
        """Ends the open item with `status` (completed, or incomplete when the response stopped short)."""
        item, self.open = self.open, None
        if item is None:
            return
        item["status"] = status
        where = self._where(item)
        if item["type"] == "function_call":
            self.record.emit("response.function_call_arguments.done", **where, arguments=item["arguments"])
        else:
            part = item["content"][0]
            prefix = TEXT_KINDS["reasoning_content" if item["type"] == "reasoning" else "content"][2]
            self.record.emit(f"{prefix}.done", **where, content_index=0, text=part["text"])
            self.record.emit("response.content_part.done", **where, content_index=0, part=part)
        self.record.emit("response.output_item.done", output_index=where["output_index"], item=item)

    def usage(self) -> dict[str, Any]:
        tokens = self.last.token_ids if self.last is not None else []
        return {"input_tokens": self.job.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": len(tokens), "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(tokens)},
                "total_tokens": self.job.prompt_tokens + len(tokens)}  # fmt: skip

    def _text(self, kind: str, delta: str) -> None:
        item_type, part_type, prefix = TEXT_KINDS[kind]
        item = self.open
        if item is None or item["type"] != item_type:
            item = self._start(item_type)
            part = {"type": part_type, "text": ""} | ({"annotations": []} if part_type == "output_text" else {})
            item["content"].append(part)
            self.record.emit("response.content_part.added", **self._where(item), content_index=0, part=part)
        item["content"][0]["text"] += delta
        extra = {"logprobs": []} if part_type == "output_text" else {}
        self.record.emit(f"{prefix}.delta", **self._where(item), content_index=0, delta=delta, **extra)

    def _call(self, fragment: dict[str, Any]) -> None:
        function = fragment.get("function") or {}
        item = self.calls.get(fragment["index"])
        if item is None:  # a call's first fragment has its id and name
            item = self._start("function_call", call_id=fragment["id"], name=function.get("name", ""), arguments="")
            self.calls[fragment["index"]] = item
        if arguments := function.get("arguments"):
            item["arguments"] += arguments
            self.record.emit("response.function_call_arguments.delta", **self._where(item), delta=arguments)

    def _start(self, item_type: str, **fields: Any) -> dict[str, Any]:
        self.close("completed")
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[item_type]
        item: dict[str, Any] = {"id": f"{prefix}_{uuid.uuid4().hex}", "type": item_type, "status": "in_progress", **fields}
        if item_type == "reasoning":
            item |= {"summary": [], "content": []}
        elif item_type == "message":
            item |= {"role": "assistant", "content": []}
        self.positions[item["id"]] = len(self.record.output)
        self.record.output.append(item)
        self.open = item
        self.record.emit("response.output_item.added", output_index=self.positions[item["id"]], item=item)
        return item

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.positions[item["id"]]}

    def _reasoning_tokens(self, tokens: list[int]) -> int:
        # Countable when the output starts inside the reasoning block: the tokens before its single-token close.
        end = self.turn.reasoning_end
        if end is None:
            return 0
        return tokens.index(end) if end in tokens else len(tokens)


async def generate(record: ResponseRecord, job: Job, turn: ChatTurn, group: RequestGroup) -> None:
    """Runs the response to its end, logging its events on `record`; cancelled, it aborts the
    engine request and ends as `cancelled` with the output so far."""
    items = OutputItems(record, job, turn)
    record.set_status("in_progress", "response.in_progress")
    try:
        async for _, out in group.outputs():
            items.push(out.outputs[0])
    except asyncio.CancelledError:
        items.flush()
        _end(record, items, "cancelled", None)
        raise
    except Exception as e:
        if not isinstance(e, EngineError):
            log.exception("%s: generation failed", record.id)
        record.error = {"code": "server_error", "message": str(e) if isinstance(e, EngineError) else "internal server error"}
        items.flush()
        _end(record, items, "failed", "response.failed")
    else:
        reason = items.last.finish_reason if items.last is not None else None
        if reason == "length":
            record.incomplete_details = {"reason": "max_output_tokens"}
            _end(record, items, "incomplete", "response.incomplete")
        elif reason == "abort":  # the engine aborted it (e.g. a drain timeout)
            _end(record, items, "cancelled", None)
        else:
            _end(record, items, "completed", "response.completed")
    finally:
        group.abort()


def _end(record: ResponseRecord, items: OutputItems, status: str, event: str | None) -> None:
    items.close("completed" if status == "completed" else "incomplete")
    record.usage = items.usage()
    record.set_status(status, event)
    log.info("%s: %s, %d output tokens", record.id, status, record.usage["output_tokens"])
