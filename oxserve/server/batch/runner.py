"""Runs batch jobs in the background, in the idle capacity interactive traffic leaves.

One job at a time, oldest first; at most `concurrency` of its lines in the engine at once,
and a line is sent only while no request waits for a batch place (so interactive requests
never queue behind batch work; under the priority policy lines also run at
`BATCH_PRIORITY`). Each result is committed before the next line is taken, so a restart
takes up exactly the lines with no result. If the store cannot write (a full disk), the
job pauses and is retried later: the unrecorded lines run again then, nothing is lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from oxserve.server.async_engine import AsyncEngine
from oxserve.server.batch.lines import answer
from oxserve.server.batch.store import BatchStore, Line, StoreError
from oxserve.server.serving import OpenAIServing

log = logging.getLogger(__name__)

BATCH_PRIORITY = 1  # above the default 0: less urgent (lower runs first)
IDLE_POLL_S = 0.05  # how often a job held back by interactive traffic looks again
STORE_RETRY_S = 5.0  # after the store failed to write


class BatchRunner:
    def __init__(self, store: BatchStore, serving: OpenAIServing, engine: AsyncEngine, concurrency: int):
        if concurrency < 1:
            raise ValueError(f"batch concurrency must be >= 1, got {concurrency}")
        self.store = store
        self.serving = serving
        self.engine = engine
        self.concurrency = concurrency
        self.priority = BATCH_PRIORITY if engine.scheduling_policy == "priority" else None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def poke(self) -> None:
        """A job was created or asked to cancel."""
        self._wake.set()

    async def close(self) -> None:
        """Stop; lines in flight are aborted and, having no result, run again after a restart."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            jobs = self.store.unfinished()
            for batch_id in jobs:
                try:
                    await self._run_job(batch_id)
                except StoreError:
                    log.exception("batch %s: the store cannot write; the job waits %.0f s", batch_id, STORE_RETRY_S)
                    await asyncio.sleep(STORE_RETRY_S)
            if not jobs:
                await self._wake.wait()

    def _cancelling(self, batch_id: str) -> bool:
        return self.store.batch(batch_id)["status"] == "cancelling"

    async def _run_job(self, batch_id: str) -> None:
        pending = deque(self.store.pending_lines(batch_id))
        running: set[asyncio.Task] = set()
        try:
            while (pending or running) and not self._cancelling(batch_id):
                while pending and len(running) < self.concurrency and self.engine.snapshot.num_waiting == 0:
                    running.add(asyncio.ensure_future(self._line(batch_id, pending.popleft())))
                if running:
                    done, running = await asyncio.wait(running, timeout=IDLE_POLL_S, return_when=asyncio.FIRST_COMPLETED)
                    _raise_store_errors(done)
                else:
                    await asyncio.sleep(IDLE_POLL_S)
        finally:  # cancelled, stopped or the store failed: what runs is aborted, to be run again
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        if self._cancelling(batch_id):
            self.store.finish(batch_id, "cancelled")
        else:
            self.store.set_status(batch_id, "finalizing")
            self.store.finish(batch_id, "completed")
        log.info("batch %s: %s", batch_id, self.store.batch(batch_id)["status"])

    async def _line(self, batch_id: str, line: Line) -> None:
        status, output = await answer(self.serving, line, self.priority)
        self.store.record(batch_id, line.line, status, output)


def _raise_store_errors(results) -> None:
    """Re-raise a line's StoreError (done tasks, or gathered results): the job must pause."""
    for r in results:
        error = r.exception() if isinstance(r, asyncio.Task) and not r.cancelled() else r
        if isinstance(error, StoreError):
            raise error
