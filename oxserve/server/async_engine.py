"""The engine behind asyncio: one engine thread owns `LLMEngine`; queues carry the rest.

    event loop thread                              engine thread (the only one calling LLMEngine)
    -----------------                              ----------------------------------------------
    submit(requests) --- _Submit ---> commands ---> add_request for each (all or none)
    RequestGroup.abort() - _Abort --> (queue.Queue)  abort_request
                                                    step() -> [RequestOutput]
    RequestGroup.queue <-- _deliver(outbox) <------ loop.call_soon_threadsafe, after the
                                                    commands and after each step

Commands are applied between steps, so an abort (a client that went away) takes effect
within one engine step and frees the request's cache. One API request becomes a
`RequestGroup`: its engine requests (n choices x prompts) are admitted together or not at
all, and their outputs arrive on one asyncio queue tagged with the choice index.

A request the engine finishes with "error" (it isolated the request as the cause of a failed
step) fails its group with an `EngineError`. An exception that escapes `step()` (a fault
outside the forward) fails the requests that were running and the loop goes on serving.
If the loop itself dies, `is_alive` turns false: /health answers 503 and the server exits.

When it has nothing to run, the engine thread gives the heap's free pages back to the OS
once per idle spell (`IDLE_TRIM`, engine/memory.py: at most every 5 s, 1-50 ms; a request
that arrives meanwhile waits for it).
A step that never returns (a hung kernel) cannot be interrupted; `declare_stalled` fails
every request from the event loop side instead and `is_alive` turns false the same way.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

from oxserve.config import EngineConfig
from oxserve.engine.engine import EngineStats, LLMEngine, Prompt
from oxserve.engine.memory import IDLE_TRIM
from oxserve.faults import Faults, InjectedFault
from oxserve.parallel.workers import ParallelError
from oxserve.outputs import RequestOutput
from oxserve.sampling_params import SamplingParams
from oxserve.server.retry_after import FinishRate
from oxserve.structured.grammar import check_constraint

log = logging.getLogger(__name__)

EngineRequest = tuple[str, Prompt, SamplingParams]  # (request id, prompt, params with n == 1)


STOP_TIMEOUT_S = 60.0  # how long stop() waits for the engine thread to finish its step
EXPIRY_CHECK_S = 1.0  # how often the engine thread looks for requests past max_queue_time (not every step)


class QueueFullError(Exception):
    """The waiting queue is at `max_waiting`; the client should retry later (HTTP 429)."""


class EngineError(Exception):
    """A request failed inside the engine (HTTP 500); the engine keeps serving."""


class QueueTimeoutError(EngineError):
    """The request waited `max_queue_time` without starting; the server is overloaded (HTTP 503)."""


@dataclass
class RequestTiming:
    arrival: float
    first_token: float | None = None


class MetricsSink(Protocol):
    def observe_finished(self, timing: RequestTiming, output: RequestOutput, now: float) -> None: ...


class RequestGroup:
    """The engine requests behind one API request, read as one stream of (index, output)."""

    def __init__(self, requests: list[EngineRequest], engine: "AsyncEngine", priority: int = 0):
        self.request_ids = [rid for rid, _, _ in requests]
        self.requests = requests
        self.priority = priority
        now = time.monotonic()
        self.timings = [RequestTiming(now) for _ in requests]
        self.queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self.admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._front = engine
        self._unfinished = set(range(len(requests)))  # reader side: not yet read to the end
        self.ended: set[int] = set()  # delivery side: a final output or a failure delivered
        self.generated = 0  # tokens of the ended requests' outputs
        self._on_done: Callable[[int], None] | None = None

    def when_done(self, callback: Callable[[int], None]) -> None:
        """Call `callback(generated tokens)` once every request has ended (now, if they have),
        whether or not anyone reads the outputs."""
        if len(self.ended) == len(self.requests):
            callback(self.generated)
        else:
            self._on_done = callback

    def settle(self, index: int, output: RequestOutput | None) -> None:
        """Delivery side: request `index` ended with `output` (None: it failed)."""
        if index in self.ended:
            return
        self.ended.add(index)
        self.generated += len(output.outputs[0].token_ids) if output is not None else 0
        if len(self.ended) == len(self.requests) and self._on_done is not None:
            self._on_done(self.generated)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(index, output) until every request finished. Outputs are cumulative, so when a
        reader falls behind, only the newest output per index is yielded."""
        while self._unfinished:
            batch = [await self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            latest: dict[int, RequestOutput] = {}
            for index, item in batch:
                if isinstance(item, BaseException):
                    self.abort()  # the group fails as a whole
                    raise item
                latest[index] = item
            for index, item in latest.items():
                if item.finished:
                    self._unfinished.discard(index)
                yield index, item

    def resolve_admission(self, error: BaseException | None) -> None:
        if self.admitted.done():  # the submitter was cancelled meanwhile; its abort is queued
            return
        if error is None:
            self.admitted.set_result(None)
        else:
            self._unfinished = set()  # nothing of it reached the engine
            self.admitted.set_exception(error)

    def abort(self) -> bool:
        """Abort what is still running; False (a no-op) once every request has finished."""
        if not self._unfinished:
            return False
        self._front.abort([self.request_ids[i] for i in self._unfinished])
        self._unfinished = set()
        return True


@dataclass
class _Submit:
    group: RequestGroup


@dataclass
class _Abort:
    request_ids: list[str] | None  # None: every request


_STOP = object()


@dataclass
class _Owner:
    group: RequestGroup
    index: int


@dataclass
class _Outbox:
    """What one loop turn hands to the event loop."""

    admissions: list[tuple[RequestGroup, BaseException | None]] = field(default_factory=list)
    outputs: list[tuple[RequestGroup, int, RequestOutput | BaseException]] = field(default_factory=list)


class AsyncEngine:
    """Builds the engine on its own thread and serves it to the event loop of `start()`.

    Only the engine thread ever runs torch, construction included: once a second thread has
    run OpenMP regions, libgomp throttles its workers' spin-waiting (more managed threads
    than cores), which made decode-sized ops about 1.7x slower on 2 cores.
    """

    _engine: LLMEngine  # built and used by the engine thread only
    snapshot: EngineStats  # the engine's counters, published by the engine thread after each loop turn

    def __init__(self, config: EngineConfig, max_waiting: int, metrics: MetricsSink | None = None,
                 max_waiting_tokens: int | None = None, max_queue_time: float | None = None):  # fmt: skip
        if max_waiting < 1 or (max_waiting_tokens is not None and max_waiting_tokens < 1):
            raise ValueError(f"max_waiting and max_waiting_tokens must be >= 1, got {max_waiting}, {max_waiting_tokens}")
        self.max_waiting = max_waiting
        self.max_waiting_tokens = max_waiting_tokens  # None: bounded by requests only
        self.max_queue_time = max_queue_time  # seconds a request may wait to start (None: no bound)
        self.scheduling_policy = config.scheduler.scheduling_policy
        self.metrics = metrics
        self.finishes = FinishRate()  # event loop only: for Retry-After
        self._commands: queue.Queue = queue.Queue()
        self._owners: dict[str, _Owner] = {}  # engine thread only
        self._outbox = _Outbox()  # engine thread only
        self._dead = False  # set once by the engine thread if its loop dies
        self._stalled = False  # set once by the event loop if a step never returned
        self._step_started: float | None = None  # set by the engine thread while a step runs
        self._next_expiry = 0.0  # engine thread only: when to look for requests past max_queue_time
        self._untrimmed = False  # engine thread only: steps ran since the heap was last trimmed
        self._groups: set[RequestGroup] = set()  # event loop only: submitted, not all ended
        self._loop: asyncio.AbstractEventLoop | None = None
        built: queue.Queue[LLMEngine | BaseException] = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(config, built), name="oxserve-engine", daemon=True)
        self._thread.start()
        engine = built.get()
        if isinstance(engine, BaseException):
            raise engine
        # Fixed once built, safe to read from any thread:
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.model_path = engine.model_path
        self.grammars = engine.grammars  # structured-output checks: thread-safe, torch-free
        self.check_prompt = engine.check_prompt  # tokenizes and places images: reads only what is fixed
        self.kv_description = engine.kv_description  # disaggregation: the caches' layout, fixed once built
        self.mm_description = engine.mm_description
        self.seed_embeddings = engine.seed_embeddings  # the encoder cache takes its own lock

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """ValueError if the engine cannot run the request's constraint; call off the event
        loop (a large schema takes a while to compile) and before submitting."""
        check_constraint(self.grammars, params.structured_outputs)

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the queue as it stands at the recent finish rate."""
        return self.finishes.retry_after(self.snapshot.num_waiting)

    # ---- event loop side ----------------------------------------------------------------
    def start(self) -> None:
        """Deliver outputs to the running event loop; call before the first submit."""
        self._loop = asyncio.get_running_loop()

    async def stop(self) -> None:
        """Abort whatever is left and end the engine thread. A thread stuck in a step is left
        behind after STOP_TIMEOUT_S (it is a daemon, gone with the process)."""
        self._commands.put(_STOP)
        if not self._stalled:
            await asyncio.to_thread(self._thread.join, STOP_TIMEOUT_S)
        if self._thread.is_alive():
            log.error("the engine thread did not stop (a step that never returns); leaving it behind")

    def stalled_for(self) -> float:
        """Seconds the step now running has taken (0: none runs)."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    def declare_stalled(self) -> None:
        """A step has run too long to be a step: fail every request now, from this side (the
        engine thread is stuck in it), and every later submit; `is_alive` turns false."""
        self._stalled = self._dead = True
        error = EngineError("the engine stalled while running this request; the server restarts")
        for group in list(self._groups):
            if not group.admitted.done():
                group.resolve_admission(_stopped())
                continue
            for index in set(range(len(group.requests))) - group.ended:
                group.settle(index, None)
                group.queue.put_nowait((index, error))
        self._groups.clear()

    @property
    def is_alive(self) -> bool:
        # _dead is set before the failures of a dying loop are handed over: whoever reads them
        # already sees the engine gone.
        return self._thread.is_alive() and not (self._dead or self._stalled)

    async def submit(self, requests: list[EngineRequest], priority: int = 0) -> RequestGroup:
        """Queue the requests (at `priority`: lower runs first, under the priority policy);
        returns once the engine admitted them all.

        Raises ValueError (bad input), QueueFullError or EngineError; then nothing is queued.
        """
        group = RequestGroup(requests, self, priority)
        self._groups.add(group)
        self._commands.put(_Submit(group))
        if self._dead:  # the loop died before or while this was queued: nobody may read it
            group.resolve_admission(_stopped())
        try:
            await group.admitted
        except asyncio.CancelledError:
            group.abort()  # queued behind the submit, so it runs after the requests were added
            self._groups.discard(group)  # nobody reads it; if admitted, its aborted outputs end it anyway
            raise
        except BaseException:
            self._groups.discard(group)
            raise
        return group

    def abort(self, request_ids: list[str] | None) -> None:
        """Abort these requests (None: all) at the next loop turn; their outputs say "abort"."""
        self._commands.put(_Abort(request_ids))

    def _deliver(self, outbox: "_Outbox") -> None:
        for group, error in outbox.admissions:
            group.resolve_admission(error)
        now = time.monotonic()
        for group, index, item in outbox.outputs:
            timing = group.timings[index]
            if isinstance(item, RequestOutput):
                if timing.first_token is None and item.outputs[0].token_ids:
                    timing.first_token = now
                if item.finished:
                    self.finishes.record()
                    if self.metrics is not None:
                        self.metrics.observe_finished(timing, item, now)
                    group.settle(index, item)
            else:
                group.settle(index, None)
            if len(group.ended) == len(group.requests):
                self._groups.discard(group)
            group.queue.put_nowait((index, item))

    # ---- engine thread ------------------------------------------------------------------
    def _run(self, config: EngineConfig, built: queue.Queue) -> None:
        try:
            self._engine = LLMEngine(config)
        except BaseException as e:
            built.put(e)
            return
        self.snapshot = self._engine.stats()
        built.put(self._engine)
        try:
            self._serve()
        except BaseException:
            log.critical("the engine loop died; failing every request it held", exc_info=True)
            self._die()
        finally:
            self._engine.close()  # tensor-parallel ranks exit with the loop

    def _serve(self) -> None:
        crash_after = Faults.from_env().crash_loop_after_steps
        steps = 0
        while True:
            for command in self._take_commands(block=not self._engine.has_unfinished_requests()):
                if command is _STOP:
                    self._abort(None)
                    self._flush()
                    return
                try:
                    self._apply(command)
                except Exception:
                    log.exception("engine command %r failed", command)
            if self.max_queue_time is not None and time.monotonic() >= self._next_expiry:
                self._next_expiry = time.monotonic() + EXPIRY_CHECK_S
                self._expire(self.max_queue_time)
            self._flush()  # admissions now, not after a step that may take a while
            if self._engine.has_unfinished_requests():
                self._step()
                self._flush()
                steps += 1
                self._untrimmed = True
                if crash_after is not None and steps >= crash_after:
                    raise InjectedFault(f"planted fault: the engine loop dies after {steps} steps")

    def _die(self) -> None:
        """The loop is gone: fail what it held and what is queued for it. A submit that comes
        later sees `_dead` and fails itself (see `submit`)."""
        self._dead = True
        outbox, self._outbox = self._outbox, _Outbox()  # what the last turn had not handed over comes first
        outbox.outputs += [(owner.group, owner.index, _failure()) for owner in self._owners.values()]
        self._owners.clear()
        for command in self._take_commands(block=False):
            if isinstance(command, _Submit):
                outbox.admissions.append((command.group, _stopped()))
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, outbox)

    def _flush(self) -> None:
        """Publish the snapshot, then hand the outbox to the event loop in one call: whoever
        sees an output sees metrics that already count it."""
        self.snapshot = self._engine.stats()
        if self._outbox.admissions or self._outbox.outputs:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._deliver, self._outbox)
            self._outbox = _Outbox()

    def _take_commands(self, block: bool) -> list:
        commands = [self._wait_idle()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _wait_idle(self):
        """The next command, trimming the heap once while waiting for it if steps ran since
        the last trim (as soon as the trim interval allows)."""
        while True:
            if self._untrimmed and IDLE_TRIM.idle():
                self._untrimmed = False
            try:
                return self._commands.get(timeout=IDLE_TRIM.wait_s() if self._untrimmed else None)
            except queue.Empty:
                continue

    def _apply(self, command: _Submit | _Abort) -> None:
        if isinstance(command, _Abort):
            self._abort(command.request_ids)
        else:
            self._outbox.admissions.append((command.group, self._add(command.group)))

    def _add(self, group: RequestGroup) -> BaseException | None:
        """Add every request of the group, or none of them; returns the error if any."""
        before = self._engine.stats()
        need, waiting = len(group.requests), before.num_waiting
        if need > self.max_waiting:
            return ValueError(f"this request needs {need} queue places; the server allows {self.max_waiting}")
        if waiting + need > self.max_waiting:
            return QueueFullError(f"the waiting queue is full ({waiting} of {self.max_waiting} places taken); retry later")
        added: list[str] = []
        try:
            for rid, prompt, params in group.requests:
                self._engine.add_request(rid, prompt, params, group.priority)
                added.append(rid)
            refused = self._over_token_bound(before.num_waiting_tokens)
        except Exception as e:
            refused = e
        if refused is not None:
            for rid in added:
                self._engine.abort_request(rid)
            if isinstance(refused, (ValueError, QueueFullError)):
                return refused
            log.error("%s: adding the request failed", group.request_ids[0], exc_info=refused)
            return EngineError("the engine could not add the request (the server's log has the details)")
        for index, rid in enumerate(added):
            self._owners[rid] = _Owner(group, index)
        return None

    def _over_token_bound(self, queued_before: int) -> Exception | None:
        """With the group just added: the error if the queue now holds too many tokens."""
        limit = self.max_waiting_tokens
        if limit is None:
            return None
        need = self._engine.stats().num_waiting_tokens - queued_before
        if need > limit:
            return ValueError(f"this request's prompts hold {need} tokens; the server queues at most {limit}")
        if queued_before + need > limit:
            return QueueFullError(f"the waiting queue is full ({queued_before} of {limit} tokens queued); retry later")
        return None

    def _abort(self, request_ids: list[str] | None) -> None:
        for rid in list(self._owners) if request_ids is None else request_ids:
            owner = self._owners.pop(rid, None)
            output = self._engine.abort_request(rid)
            if owner is not None and output is not None:
                self._outbox.outputs.append((owner.group, owner.index, output))

    def _expire(self, max_age: float) -> None:
        """Fail the requests that have waited `max_age` seconds since they were submitted
        without starting: their clients are better told now than served after they left."""
        now = time.monotonic()
        for rid in self._engine.unstarted_request_ids():
            owner = self._owners.get(rid)
            waited = 0.0 if owner is None else now - owner.group.timings[owner.index].arrival
            if waited > max_age:
                self._owners.pop(rid)
                self._engine.abort_request(rid)
                error = QueueTimeoutError(f"the server is overloaded: the request waited {waited:.0f} s without starting "
                                          f"(the bound is {max_age:g} s); retry later")  # fmt: skip
                self._outbox.outputs.append((owner.group, owner.index, error))

    def _step(self) -> None:
        self._step_started = time.monotonic()
        try:
            outputs = self._engine.step()
        except ParallelError:
            raise  # a lost rank: the loop dies, and every request with it
        except Exception as e:
            failed = self._engine.running_request_ids()
            log.exception("engine step failed; failing the requests in it: %s", ", ".join(failed))
            self._fail(failed, e)
            return
        finally:
            self._step_started = None
        for out in outputs:
            owner = self._owners.pop(out.request_id) if out.finished else self._owners[out.request_id]
            failed = out.finished and out.outputs[0].finish_reason == "error"  # the engine isolated it as the fault
            self._outbox.outputs.append((owner.group, owner.index, _failure() if failed else out))

    def _fail(self, request_ids: list[str], error: Exception) -> None:
        for rid in request_ids:
            try:
                self._engine.abort_request(rid)
            except Exception:
                log.exception("%s: aborting after a failed step failed too", rid)
            if (owner := self._owners.pop(rid, None)) is not None:
                self._outbox.outputs.append((owner.group, owner.index, _failure()))


def _stopped() -> EngineError:
    return EngineError("the engine is not running (the server's log has the details)")


def _failure() -> EngineError:
    # What went wrong stays in the log: an error body must not show the server's internals.
    return EngineError("the engine failed while running this request (the server's log has the details)")
