"""Runs batch jobs in the background, in the idle capacity interactive traffic leaves.

One job at a time, oldest first; at most `concurrency` of its lines in the engine at once,
and a line is sent only while no request waits for a batch place (under the priority policy
lines also run at `BATCH_PRIORITY`, so interactive requests go first even when they come
later). Each answer is committed before its line counts as done, so a restart takes up
exactly the lines with no answer.

Only a line's own answer is committed. A refusal that says nothing about the line (a full
queue, a queue timeout, a server draining), an answer cut short by an abort, or any failure
while the engine is gone leaves the line unanswered: it is sent again later, or after the
restart. If the store cannot write (a full disk), the job pauses and is retried later.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from oxserve.server.async_engine import AsyncEngine
from oxserve.server.batch.lines import answer
from oxserve.server.batch.store import BatchStore, Line, StoreError
from oxserve.server.serving import OpenAIServing

log = logging.getLogger(__name__)

BATCH_PRIORITY = 1  # above the default 0: less urgent (lower runs first)
IDLE_POLL_S = 0.05  # how often a job held back by interactive traffic looks again
RETRY_S = 1.0  # after a line was refused for a reason that is not its own
STORE_RETRY_S = 5.0  # after the store failed to write
TRANSIENT_STATUS = (429, 503)  # the server's state, not the line's


class _Unanswered(Exception):
    """The line got no answer of its own; it runs again."""


class BatchRunner:
    def __init__(self, store: BatchStore, serving: OpenAIServing, engine: AsyncEngine, concurrency: int,
                 accepting: Callable[[], bool] = lambda: True):  # fmt: skip
        """`accepting`: false while the server drains (no new line is sent)."""
        if concurrency < 1:
            raise ValueError(f"batch concurrency must be >= 1, got {concurrency}")
        self.store = store
        self.serving = serving
        self.engine = engine
        self.concurrency = concurrency
        self.accepting = accepting
        self.priority = BATCH_PRIORITY if engine.scheduling_policy == "priority" else None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def poke(self) -> None:
        """A job was created or asked to cancel."""
        self._wake.set()

    async def close(self) -> None:
        """Stop; lines in flight are aborted and, having no answer, run again after a restart."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while self.engine.is_alive:
            self._wake.clear()
            jobs = await self.store.call(self.store.unfinished)
            for batch_id in jobs:
                try:
                    await self._run_job(batch_id)
                except StoreError:
                    log.exception("batch %s: the store cannot write; the job waits %.0f s", batch_id, STORE_RETRY_S)
                    await asyncio.sleep(STORE_RETRY_S)
            if not jobs:
                await self._wake.wait()
        log.warning("batch jobs stop: the engine is gone (unanswered lines run after the restart)")

    async def _cancelling(self, batch_id: str) -> bool:
        return (await self.store.call(self.store.batch, batch_id))["status"] == "cancelling"

    def _may_send(self) -> bool:
        return self.accepting() and self.engine.snapshot.num_waiting == 0

    async def _run_job(self, batch_id: str) -> None:
        pending = deque(await self.store.call(self.store.pending_lines, batch_id))
        running: dict[asyncio.Task, Line] = {}
        try:
            while (pending or running) and not await self._cancelling(batch_id):
                if not self.engine.is_alive:
                    return  # nothing is committed for what was running; the job waits for the restart
                while pending and len(running) < self.concurrency and self._may_send():
                    line = pending.popleft()
                    running[asyncio.ensure_future(self._line(batch_id, line))] = line
                if not running:
                    await asyncio.sleep(IDLE_POLL_S)
                    continue
                done, _ = await asyncio.wait(running, timeout=IDLE_POLL_S, return_when=asyncio.FIRST_COMPLETED)
                again = []
                for task in sorted(done, key=lambda t: running[t].line):
                    line, error = running.pop(task), task.exception()
                    if isinstance(error, StoreError):
                        raise error
                    if error is not None:
                        if not isinstance(error, _Unanswered):
                            log.error("batch %s line %r failed; it runs again", batch_id, line.custom_id, exc_info=error)
                        again.append(line)
                if again:
                    pending.extendleft(reversed(again))  # first again, in order
                    await asyncio.sleep(RETRY_S)
        finally:  # cancelled, stopped or the store failed: what runs is aborted, to be run again
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        if await self._cancelling(batch_id):
            await self.store.call(self.store.finish, batch_id, "cancelled")
        else:
            await self.store.call(self.store.set_status, batch_id, "finalizing")
            await self.store.call(self.store.finish, batch_id, "completed")
        log.info("batch %s: %s", batch_id, (await self.store.call(self.store.batch, batch_id))["status"])

    async def _line(self, batch_id: str, line: Line) -> None:
        status, output = await answer(self.serving, line, self.priority)
        body = output["response"]["body"]
        aborted = any(c.get("finish_reason") == "abort" for c in body.get("choices", []))
        if status in TRANSIENT_STATUS or aborted or not self.engine.is_alive:
            raise _Unanswered(f"{line.custom_id}: {status}")
        await self.store.call(self.store.record, batch_id, line.line, status, output)
