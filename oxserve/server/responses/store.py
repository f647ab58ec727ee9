"""Responses as the server keeps them: each with its output so far and its event log, so a
client can poll it, or re-attach to its stream from any sequence number, while it runs.

Everything here runs on the event loop thread, so no locks: a record's readers wait on an
asyncio.Event that is set and replaced on every change.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Coroutine
from typing import Any, Protocol

from oxserve.server.async_engine import RequestGroup
from oxserve.server.protocol import APIError
from oxserve.server.responses.protocol import FunctionChoice, InputItem, ResponsesRequest

log = logging.getLogger(__name__)

FINAL = frozenset({"completed", "incomplete", "cancelled", "failed"})
DEFAULT_MAX_STORED = 1000


class ResponseRecord:
    """One response: what it was asked (`request`, `history`), what it has said so far
    (`output`, `status`, ...), and every event it streamed, its index its sequence number."""

    def __init__(self, response_id: str, request: ResponsesRequest, history: list[InputItem], model: str):
        self.id, self.request, self.history, self.model = response_id, request, history, model
        self.created_at = int(time.time())
        self.completed_at: int | None = None
        self.status = "queued" if request.background else "in_progress"
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete_details: dict[str, Any] | None = None
        self.events: list[str] = []  # SSE-encoded when emitted: a snapshot, however the output changes later
        self.task: asyncio.Task | None = None
        self._changed = asyncio.Event()

    @property
    def done(self) -> bool:
        return self.status in FINAL

    def emit(self, kind: str, **fields: Any) -> None:
        event = {"type": kind, "sequence_number": len(self.events), **fields}
        self.events.append(f"event: {kind}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n")
        self._wake()

    def set_status(self, status: str, event: str | None = None) -> None:
        """Moves to `status`, announcing it with `event` (which carries the whole response)."""
        self.status = status
        if status in FINAL:
            self.completed_at = int(time.time())
        if event is not None:
            self.emit(event, response=self.body())
        self._wake()

    async def wait(self) -> ResponseRecord:
        while not self.done:
            await self._changed.wait()
        return self

    async def follow(self, after: int) -> AsyncIterator[str]:
        """The events after sequence number `after`: the logged ones, then live ones until the end."""
        sent = max(after + 1, 0)
        while True:
            changed = self._changed  # taken before reading, so a change while we yield is not missed
            while sent < len(self.events):
                yield self.events[sent]
                sent += 1
            if self.done:
                return
            await changed.wait()

    def body(self) -> dict[str, Any]:
        r = self.request
        fmt = r.text.format.echo() if r.text and r.text.format else {"type": "text"}
        tool_choice = r.tool_choice.model_dump() if isinstance(r.tool_choice, FunctionChoice) else r.tool_choice or "auto"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "completed_at": self.completed_at,
            "status": self.status, "model": self.model, "output": self.output, "error": self.error,
            "incomplete_details": self.incomplete_details, "usage": self.usage,
            "instructions": r.instructions, "metadata": r.metadata or {}, "previous_response_id": r.previous_response_id,
            "background": r.background, "store": r.store, "max_output_tokens": r.max_output_tokens,
            "temperature": 1.0 if r.temperature is None else r.temperature, "top_p": 1.0 if r.top_p is None else r.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or []], "tool_choice": tool_choice,
            "parallel_tool_calls": r.parallel_tool_calls, "text": {"format": fmt}, "truncation": "disabled", "user": r.user,
            "reasoning": r.reasoning.model_dump() if r.reasoning else {"effort": None, "summary": None},
        }  # fmt: skip

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class InFlight(Protocol):
    def enter(self) -> None: ...
    def leave(self) -> None: ...


class ResponseStore:
    """The stored responses, at most `max_stored` (the oldest finished ones go first), and the
    tasks generating responses, held here so none is garbage-collected mid-run."""

    def __init__(self, max_stored: int = DEFAULT_MAX_STORED, in_flight: InFlight | None = None):
        self.max_stored = max_stored
        self.in_flight = in_flight  # the server's count of work in progress: a drain waits for responses too
        self._records: OrderedDict[str, ResponseRecord] = OrderedDict()
        self._tasks: set[asyncio.Task] = set()

    def add(self, record: ResponseRecord) -> None:
        self._records[record.id] = record
        while len(self._records) > self.max_stored:
            oldest = next((rid for rid, r in self._records.items() if r.done), None)
            if oldest is None:  # all still running: those are bounded by the engine's queue
                return
            del self._records[oldest]

    def get(self, response_id: str) -> ResponseRecord:
        record = self._records.get(response_id)
        if record is None:
            raise APIError(404, f"no response with id {response_id!r} (never stored, deleted, or evicted)", "not_found_error",
                           "response_id")  # fmt: skip
        return record

    def delete(self, response_id: str) -> ResponseRecord:
        record = self.get(response_id)
        del self._records[response_id]
        return record

    def run(self, record: ResponseRecord, group: RequestGroup, work: Coroutine[Any, Any, None]) -> asyncio.Task:
        """Runs `work`, generating `record` from `group`, as a task held until it ends."""

        def settle(task: asyncio.Task) -> None:
            self._tasks.discard(task)
            if self.in_flight is not None:
                self.in_flight.leave()
            if not record.done:  # cancelled before its first step, so `work` never ran to clean up
                group.abort()
                record.set_status("cancelled")

        task = asyncio.get_running_loop().create_task(work, name=record.id)
        record.task = task
        self._tasks.add(task)
        if self.in_flight is not None:
            self.in_flight.enter()
        task.add_done_callback(settle)
        return task

    async def close(self) -> None:
        """Cancels every running response (server shutdown): their engine requests are aborted."""
        tasks = list(self._tasks)
        if tasks:
            log.info("shutdown: cancelling %d running response(s)", len(tasks))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
