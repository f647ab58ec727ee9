"""Captured decode steps: a decode step recorded once, then replayed without its Python.

A decode step of a small batch costs what its Python costs: ~130 kernel calls, each behind
module calls, views and allocations (a batch-1 step of the default model is ~4 ms, its
bytes 0.5 ms). This is the CPU counterpart of vLLM's CUDA graphs. A decode step of a given
shape (the second one met: see below) runs eagerly under a recording that keeps, in order, every native kernel call
(`kernels.native.recording`: the function and its arguments, pointers included) and every
torch op (`TorchDispatchMode`: the op, its arguments, its outputs), and keeps alive every
tensor those pointers and arguments name. The next step of the same shape copies its inputs
(token ids, the `ForwardBatch` tensors) into the recorded step's own input tensors and runs
the recorded calls in a loop: the same kernels on the same memory, with no module, wrapper
or allocation in between; each run of consecutive kernel calls is made from C in one ctypes
call (`kernels.call_list`: arguments converted once, at the first replay). Results are
bit-identical to the eager step's (tested). A steady step of plain decodes skips even the
`ForwardBatch`: the runner writes its metadata straight into the recording's tensors
(`steady_decodes`, `model.batch.DecodeRows`).

What makes a replay valid, and how it is kept so:
- the shape key (`step_key`) holds everything host-side the model branches on: every
  non-tensor field of the batch (the number of requests, query lengths, `seq_len_bound`,
  ...) and every tensor's shape; a step whose key differs is captured anew;
- per-step host values that the key leaves out (the context lengths; with ReplaySSM, the
  ring counts, which the kernels take as a tensor and fold by themselves) are watched while
  capturing: a model that reads them is refused a recording for that shape (its steps run
  eagerly, still right);
- so is one that reads tensor values at host level or draws random numbers (`.item()`,
  `bool(t)`, `tolist()`, `nonzero`, masks: torch's `data_dependent_output`,
  `dynamic_output_shape` and `nondeterministic_seeded` tags, and the ops `bool` and
  `tolist` dispatch without them) -- which also keeps Python hooks on the model (the fault
  injection's) running in every step;
- a kernel call that returns something other than what it returned while recording (a
  failure status) fails the replay loudly.

Profiling sees replayed steps as served: the recording keeps each op span of the recorded
step as the range of calls made inside it, and a replay with a tracer times the calls and
reports those spans (a span with no recorded call, a view, lasts zero).

Unlike a CUDA graph, a recording costs about two ordinary steps (it is one, plus the
dispatch mode's few microseconds an op), and nothing needs a disk cache. The runner pads a
decode batch to the next captured batch size (`engine.padding`: 1, 2, 3, 4, 6, 8, 12, ... by
default), or to a larger one already recorded while recording its own would not yet pay, so
that the batch sizes of a ramp or a tail share a few recordings; such a shape, expected
again, is recorded when first met; any other shape (a verify step's, whose
draft lengths vary) the second time it occurs, so that a shape met once only runs eagerly. At
most 32 recordings holding at most 1 GiB of intermediate tensors together are kept (least
recently replayed dropped first).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch.nn.modules import module as torch_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from oxserve.cache.replay import RingCounts
from oxserve.engine.interface import NEW_SHAPE, SETTLING, STEADY
from oxserve.kernels import native
from oxserve.kernels.call_list import CallRun, callable_natively
from oxserve.model.batch import DecodeRows, ForwardBatch
from oxserve.telemetry import Span, Tracer, span

log = logging.getLogger(__name__)

aten = torch.ops.aten
# Host-side values that change from step to step and that the model must not read in a
# captured step (their tensors carry them): left out of the key, unreadable while capturing.
PER_STEP_FIELDS = {ForwardBatch: ("context_lens",), RingCounts: ("decodes", "verifies")}
NOT_REPLAYABLE_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape,
                       torch.Tag.nondeterministic_seeded)  # fmt: skip
# Host reads without those tags: `bool(t)`, and what `tolist()` / `numpy()` call before reading.
HOST_READS = frozenset({aten.is_nonzero.default, aten.resolve_conj.default, aten.resolve_neg.default})
# Allocations: a replay reuses the recorded tensor, whose contents the next op writes.
ALLOCATIONS = frozenset({aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default,
                         aten.empty_strided.default, aten.new_empty_strided.default})  # fmt: skip
DEFAULT_MAX_RECORDINGS = 32
DEFAULT_MAX_RECORDING_BYTES = 1 << 30  # the kept recordings' intermediate tensors, together
SEEN_SHAPES = 1024  # shapes met once, remembered (least recently met forgotten first)


class PerStepValue(list):
    """A per-step host value of the batch being captured: still readable (the step runs for
    real), but reading it tells the recording that a replay would repeat a stale value."""

    def __init__(self, name: str, values: list, refuse: Callable[[str], None]):
        super().__init__(values)
        self.name, self.refuse = name, refuse

    def _read(method):  # noqa: N805 -- wraps list's own methods
        def read(self, *args):
            self.refuse(f"the model read {self.name}")
            return method(self, *args)

        return read

    __iter__, __getitem__, __len__ = _read(list.__iter__), _read(list.__getitem__), _read(list.__len__)


class StepRecording:
    """What one eager step did, as calls to repeat in order on the same tensors."""

    def __init__(self) -> None:
        self.calls: list[tuple[Callable, tuple, Any]] = []  # (callable, arguments, what it must return)
        self.keep: list[Any] = []  # every tensor the step made or read: the memory its calls name
        self.made: dict[int, int] = {}  # storages the step allocated (address -> bytes): what keeping it costs
        self.inputs: tuple[torch.Tensor, ...] = ()  # the step's input tensors, which each replay refills
        self.batch_tensors: list[torch.Tensor] = []  # the batch's tensors, which each replay refills
        self.output: Any = None  # what the step returned: its tensors are the recorded ones
        self.refusal: str | None = None  # why a replay could not repeat this step (None: it can)
        self.spans: list[RecordedSpan] = []  # the model's op spans, as ranges of `calls`
        # A step of plain decodes: (requests, seq_len_bound, block table width), which make its key,
        # and on CPU the writer of a steady step of that shape into its tensors
        self.decode_shape: tuple[int, int, int] | None = None
        self.decode_rows: DecodeRows | None = None
        self.step_s = 0.0  # what a replay takes: the recording step's time until replays are timed
        self._plan = self._traced_plan = None  # `calls` as replays run them (built at the first)

    def planned(self, traced: bool) -> bool:
        """Whether a replay (with a tracer, or without) finds its plan made: the first builds it
        (~3 ms at batch 4 on a Xeon, against a 1.1 ms replay)."""
        return (self._traced_plan if traced else self._plan) is not None

    def refuse(self, why: str) -> None:
        self.refusal = self.refusal or why

    def native_call(self, function, args: tuple, result) -> None:
        self.calls.append((function, args, result))

    def torch_op(self, func, args: tuple, kwargs: dict, out) -> None:
        try:
            self._torch_op(func, args, kwargs, out)
        except Exception as e:  # noqa: BLE001 -- a recording's own failure must not fail the step it records
            self.refuse(f"recording {func} failed: {e!r}")

    def _torch_op(self, func, args: tuple, kwargs: dict, out) -> None:
        tensors_in = _tensors(args) + _tensors(kwargs.values())
        reads_host, kind = _kind(func)
        if reads_host and not _integer_indexing(func, tensors_in):
            self.refuse(f"{func} depends on tensor values at host level")
        tensors_out = [out] if isinstance(out, torch.Tensor) else _tensors(out) if isinstance(out, (tuple, list)) else []
        self.keep += tensors_in + tensors_out
        if kind is ALLOCATION:
            self._made(tensors_out)
            return
        if kind is IN_PLACE:  # or into out=: the same call again
            self.calls.append((_run_in_place, (func, args, kwargs), None))
            return
        storages = {_storage(t) for t in tensors_in}
        fresh = [t for t in tensors_out if _storage(t) not in storages]
        self._made(fresh)
        if fresh:  # a new result (not a view of an input): recompute it into the recorded tensor
            self.calls.append((_run_into, (func, args, kwargs, tuple(tensors_out)), None))

    def _made(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if not t.is_mkldnn:
                self.made[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    @property
    def nbytes(self) -> int:
        return sum(self.made.values())

    def replay(self, tracer: Tracer | None = None) -> Any:
        """Run the recorded calls; with a tracer, also time them and report the model's op
        spans as the eager step would (each spans the recorded calls made inside it)."""
        if tracer is not None:
            return self._traced_replay(tracer)
        if self._plan is None:
            self._plan = self._steps(frozenset())
        for _, function, args, expected in self._plan:
            _check(function, function(*args), expected)
        return self.output

    def _traced_replay(self, tracer: Tracer) -> Any:
        if self._traced_plan is None:  # runs of native calls end where spans do
            self._traced_plan = self._steps(frozenset(b for s in self.spans for b in (s.first_call, s.end_call)))
        marks = {}  # call index -> when the plan step starting there started; len(calls): the end
        for first, function, args, expected in self._traced_plan:
            marks[first] = tracer.synced_now_us()
            _check(function, function(*args), expected)
        marks[len(self.calls)] = tracer.synced_now_us()
        for s in self.spans:
            start = marks[s.first_call]
            tracer.spans.append(Span(s.name, start, marks[s.end_call] - start, s.track, tracer.depth + s.depth, dict(s.args)))
        return self.output

    def _steps(self, boundaries: frozenset[int]) -> list[tuple[int, Callable, tuple, Any]]:
        """The calls as (index of the first, callable, arguments, result it must return): a run
        of native kernel calls that crosses none of the `boundaries` becomes one `CallRun`."""
        steps: list[tuple[int, Callable, tuple, Any]] = []
        i = 0
        while i < len(self.calls):
            end = i
            while end < len(self.calls) and callable_natively(*self.calls[end][:2]) and (end == i or end not in boundaries):
                end += 1
            run = CallRun.build(self.calls[i:end]) if end - i > 1 else None
            if run is None:
                end = i + 1
                steps.append((i, *self.calls[i]))
            else:
                steps.append((i, run, (), None))
            i = end
        return steps


def _check(function, result, expected) -> None:
    if result != expected:
        raise RuntimeError(f"captured step: {getattr(function, '__name__', function)} returned {result}, "
                           f"{expected} when recorded")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RecordedSpan:
    """A span of the recorded step: the calls `first_call` to `end_call` (exclusive) ran in it."""

    name: str
    track: str
    depth: int  # below the span the step itself ran in
    args: dict
    first_call: int
    end_call: int


class SpanMarks:
    """The tracer a step sees while it is recorded: notes which recorded calls each span
    covers (for traced replays) and passes the span on to the step's own tracer, if any."""

    def __init__(self, recording: StepRecording, tracer: Tracer | None):
        self.recording, self.tracer = recording, tracer
        self.depth = 0

    @contextlib.contextmanager
    def span(self, name: str, track: str = "model", **args):
        first, depth = len(self.recording.calls), self.depth
        self.depth += 1
        try:
            with span(self.tracer, name, track, **args) as traced_args:
                args = args if traced_args is None else traced_args  # what the block may add to
                yield args
        finally:
            self.depth -= 1
        self.recording.spans.append(RecordedSpan(name, track, depth, dict(args), first, len(self.recording.calls)))


ALLOCATION, IN_PLACE, FUNCTIONAL = "allocation", "in place", "functional"


@functools.cache
def _kind(func) -> tuple[bool, str]:
    """(whether the op may read tensor values at host level, how a replay repeats it); cached:
    a capture meets each op many times."""
    reads_host = func in HOST_READS or any(tag in func.tags for tag in NOT_REPLAYABLE_TAGS)
    if func in ALLOCATIONS:
        return reads_host, ALLOCATION
    return reads_host, IN_PLACE if func._schema.is_mutable else FUNCTIONAL


def _tensors(values) -> list[torch.Tensor]:
    """The tensors among `values`, and in lists among them (an op's arguments are no deeper)."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [v for v in value if isinstance(v, torch.Tensor)]
    return found


def _storage(t: torch.Tensor) -> int | None:
    """Where a tensor's memory starts (None for oneDNN's opaque packed weights, never an output)."""
    return None if t.is_mkldnn else t.untyped_storage().data_ptr()


def _integer_indexing(func, tensors_in: list[torch.Tensor]) -> bool:
    """Indexing by integer tensors: its shape follows the indices' shapes (a boolean mask's would not)."""
    return func in (aten.index.Tensor, aten.index_put_.default) and all(
        t.dtype not in (torch.bool, torch.uint8) for t in tensors_in[1:])


def _run_in_place(func, args, kwargs) -> None:
    func(*args, **kwargs)


def _run_into(func, args, kwargs, outs: tuple[torch.Tensor, ...]) -> None:
    values = func(*args, **kwargs)
    if len(outs) == 1 and isinstance(values, torch.Tensor):
        outs[0].copy_(values)
        return
    for out, value in zip(outs, tree_leaves(values)):
        out.copy_(value)


class _TorchOps(TorchDispatchMode):
    def __init__(self, recording: StepRecording):
        super().__init__()
        self.recording = recording

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing here is compiled: torch would otherwise import torch._dynamo (~1 s) to wrap the hook

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.recording.torch_op(func, args, kwargs, out)
        return out


StepInputs = torch.Tensor | tuple[torch.Tensor, ...]  # what a step takes beside its batch: token ids, ...


def _as_tuple(inputs: StepInputs) -> tuple[torch.Tensor, ...]:
    return (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)


def step_key(inputs: StepInputs, batch: ForwardBatch) -> tuple[tuple, list[torch.Tensor]]:
    """(everything host-side the model may branch on: the inputs' and the batch's tensors'
    shapes and dtypes, the batch's non-tensor values; the batch's tensors in a fixed order,
    nested layouts included)."""
    key: list = [tuple((tuple(t.shape), t.dtype) for t in _as_tuple(inputs))]
    tensors: list[torch.Tensor] = []
    _walk(batch, key, tensors)
    return tuple(key), tensors


def _walk(value, key: list, tensors: list[torch.Tensor]) -> None:
    for name in _fields(type(value)):
        item = getattr(value, name)
        if isinstance(item, torch.Tensor):
            key.append((item.shape, item.dtype))
            tensors.append(item)
        elif dataclasses.is_dataclass(item):
            _walk(item, key, tensors)
        else:
            key.append(tuple(item) if isinstance(item, list) else item)


@functools.cache
def _fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in PER_STEP_FIELDS.get(cls, ()) and f.name != "tracer")


def _watched(value, refuse: Callable[[str], None]):
    """A copy of `value` (a dataclass) whose per-step host values, those of the dataclasses it
    holds included, tell `refuse` when they are read."""
    changes = {name: PerStepValue(f"{type(value).__name__}.{name}", getattr(value, name), refuse)
               for name in PER_STEP_FIELDS.get(type(value), ())}  # fmt: skip
    for name in _fields(type(value)):
        if type(item := getattr(value, name)) in PER_STEP_FIELDS:
            changes[name] = _watched(item, refuse)
    return dataclasses.replace(value, **changes)


def has_forward_hooks(model: torch.nn.Module) -> bool:
    """Hooks on the model itself or on every module (submodules' own are not looked for)."""
    return bool(model._forward_pre_hooks or model._forward_hooks or torch_module._global_forward_pre_hooks
                or torch_module._global_forward_hooks)  # fmt: skip


class CapturedDecode:
    """Decode steps replayed from recordings, by shape key; `forward(*inputs, batch)` is
    the eager step (`inputs`: the token ids, or a tuple of input tensors), returning its
    outputs. Batches of more than `max_requests` run eagerly (the runner pads decode batches
    to the captured sizes: `engine.padding`)."""

    def __init__(self, forward: Callable[..., Any],
                 max_requests: int | None = None, max_recordings: int = DEFAULT_MAX_RECORDINGS,
                 max_bytes: int = DEFAULT_MAX_RECORDING_BYTES):  # fmt: skip
        self.forward = forward
        self.max_requests = max_requests
        self.max_recordings, self.max_bytes = max_recordings, max_bytes
        self.recordings: OrderedDict[tuple, StepRecording] = OrderedDict()
        self.refused: dict[tuple, str] = {}  # keys whose capture failed, and why: they run eagerly
        self.seen: OrderedDict[tuple, None] = OrderedDict()  # shapes met once (recorded when met again)
        self._decode_keys: dict[tuple[int, int, int], tuple] = {}  # recordings of plain decodes: shape -> key
        self.replays = self.captures = 0
        self.capture_s = 0.0  # time in steps that recorded (each an eager step plus the recording's cost)
        self._kept_s = 0.0  # of that, in the steps whose recording was kept (the `captures`)
        self.novelty = STEADY  # the last step's (`engine.interface`: NEW_SHAPE, SETTLING)

    def wants(self, batch: ForwardBatch) -> bool:
        """A step of decodes (one new token per request) and verifies (a token and its drafts)
        only, of at most `max_requests` requests."""
        return (batch.num_decodes + batch.num_verifies == batch.num_requests
                and (self.max_requests is None or batch.num_requests <= self.max_requests))  # fmt: skip

    def run(self, inputs: StepInputs, batch: ForwardBatch, recurs: bool = False) -> Any:
        """The outputs of this decode step (tensors the next replay of its shape overwrites).
        `recurs`: the caller expects the shape again (a batch padded to a captured size), so
        it is recorded when first met, not after an eager step."""
        inputs = _as_tuple(inputs)
        key, tensors = step_key(inputs, batch)
        recording = self.recordings.get(key)
        if recording is not None:
            self.novelty = STEADY if recording.planned(batch.tracer is not None) else SETTLING
        else:
            self.novelty = STEADY if key in self.refused else SETTLING if key in self.seen or recurs else NEW_SHAPE
        if recording is not None:
            self.recordings.move_to_end(key)
            start = time.perf_counter()
            for mine, new in zip(recording.inputs, inputs):
                mine.copy_(new)
            for mine, new in zip(recording.batch_tensors, tensors):
                mine.copy_(new)
            if recording.decode_rows is not None:  # (what it remembers of the rows it wrote no longer holds)
                recording.decode_rows.forget()
            return self._replay(recording, batch.tracer, start)
        if key in self.refused:
            return self.forward(*inputs, batch)
        if key not in self.seen and not recurs:  # recording costs 2x an eager step: not for shapes met once
            self.seen[key] = None
            if len(self.seen) > SEEN_SHAPES:
                self.seen.popitem(last=False)
            return self.forward(*inputs, batch)
        self.seen.pop(key, None)
        return self._capture(key, inputs, batch)

    def _replay(self, recording: StepRecording, tracer: Tracer | None, start: float) -> Any:
        self.replays += 1
        outputs = recording.replay(tracer)
        if self.novelty == STEADY and tracer is None:  # (a first replay also builds its plan)
            recording.step_s = time.perf_counter() - start
        return outputs

    def steady_decodes(self, shape: tuple[int, int, int]) -> StepRecording | None:
        """The recording of plain decode steps of `shape` (requests, seq_len_bound, block table
        width: `model.batch.table_shape`) whose replays run a plan already made, if one is kept:
        the caller writes its step into the recording's own tensors (`recording.decode_rows`),
        then calls `replay_steady`. This skips building a `ForwardBatch`, its key and a copy a
        tensor: 0.3 of a 2.4 ms batch-1 step on a first-generation EPYC, all of it host work on
        cold caches. CPU tensors only (elsewhere None)."""
        key = self._decode_keys.get(shape)
        recording = None if key is None else self.recordings.get(key)
        if recording is None or recording.decode_rows is None or not recording.planned(traced=False):
            return None
        return recording

    def replay_steady(self, recording: StepRecording) -> Any:
        """Replay a recording of `steady_decodes`, its inputs written (no tracer: a traced
        replay times spans, and the runner's traced steps take `run`)."""
        self.recordings.move_to_end(self._decode_keys[recording.decode_shape])
        self.novelty = STEADY
        return self._replay(recording, None, time.perf_counter())

    def _capture(self, key: tuple, inputs: tuple[torch.Tensor, ...], batch: ForwardBatch) -> Any:
        """Run the step eagerly under a recording; keep the recording if a replay can repeat it."""
        start = time.perf_counter()
        recording = StepRecording()
        # Not kept on the recording: its per-step values point back at it (a cycle that would keep
        # the recorded tensors, the caches among them, alive until the garbage collector ran).
        watched = dataclasses.replace(_watched(batch, recording.refuse), tracer=SpanMarks(recording, batch.tracer))
        recording.inputs, recording.batch_tensors = inputs, step_key(inputs, watched)[1]
        with native.recording(recording.native_call), _TorchOps(recording):
            recording.output = self.forward(*inputs, watched)
        self.capture_s += time.perf_counter() - start
        if recording.refusal is not None:
            log.warning("oxserve: decode steps of shape %d x %d run eagerly: %s", batch.num_requests,
                        batch.num_tokens, recording.refusal)  # fmt: skip
            self.refused[key] = recording.refusal
            return recording.output
        self.captures += 1
        recording.step_s = time.perf_counter() - start
        self._kept_s += recording.step_s
        if batch.num_decodes == batch.num_requests and batch.logits_indices.shape[0] == batch.num_requests:
            recording.decode_shape = (batch.num_requests, batch.seq_len_bound, batch.block_tables.shape[1])
            if batch.positions.device.type == "cpu":  # (the batch's tensors are the recorded ones)
                recording.decode_rows = DecodeRows(batch, inputs[0])
            self._decode_keys[recording.decode_shape] = key
        self.recordings[key] = recording
        while len(self.recordings) > 1 and (len(self.recordings) > self.max_recordings or self.nbytes > self.max_bytes):
            dropped_key, dropped = self.recordings.popitem(last=False)  # the least recently replayed
            if self._decode_keys.get(dropped.decode_shape) == dropped_key:
                del self._decode_keys[dropped.decode_shape]
        return recording.output

    def decode_sizes(self, seq_len_bound: int, width: int) -> dict[int, float]:
        """The batch sizes of plain decode steps recorded at this table shape (`table_shape`),
        with the seconds their replays take."""
        return {r.decode_shape[0]: r.step_s for r in self.recordings.values()
                if r.decode_shape is not None and r.decode_shape[1:] == (seq_len_bound, width)}  # fmt: skip

    @property
    def recording_s(self) -> float:
        """The mean time of a step whose recording was kept (0 before the first)."""
        return self._kept_s / self.captures if self.captures else 0.0

    @property
    def nbytes(self) -> int:
        """Activation memory the kept recordings hold."""
        return sum(r.nbytes for r in self.recordings.values())
