"""Steps -> Trace Event Format (`trace.json`, opens in Perfetto and chrome://tracing).

Everything is on one thread track, nested by time:

    step (phase, conditions)
      schedule | prepare_inputs | forward (conditions) | sample | postprocess
                                    embed | L0 ... L7 | final_norm | lm_head
                                            L3.hc.collapse | L3.mla.q_proj | ...

`L{i}` spans are derived (first to last op of the layer, cat "layer") so a layer can be
selected and summed in the viewer; a counter track shows each forward pass's batch.
Timestamps are µs from the tracer's origin, rounded to ns.
"""

from __future__ import annotations

import json
from pathlib import Path

from oxserve.profiling.spans import ForwardPass, Step

PID = 1
TID = 1


def trace_events(steps: list[Step]) -> list[dict]:
    events = [
        {"name": "process_name", "ph": "M", "ts": 0, "pid": PID, "tid": TID, "args": {"name": "oxserve engine"}},
        {"name": "thread_name", "ph": "M", "ts": 0, "pid": PID, "tid": TID, "args": {"name": "engine steps"}},
    ]
    for index, step in enumerate(steps):
        events.append(_complete("step", "step", step.start_us, step.dur_us, {"index": index, **_step_args(step)}))
        forwards = iter(step.forwards)
        for span in step.engine_spans:
            args = dict(span.args)
            if span.name == "forward":
                fwd = next(forwards)
                args["phase"] = fwd.shape.phase
                events.append(_counter(fwd))
            events.append(_complete(span.name, "engine", span.start_us, span.dur_us, args))
        for fwd in step.forwards:
            events.extend(_model_events(fwd))
    return events


def write_trace(steps: list[Step], path: str | Path, metadata: dict | None = None) -> Path:
    path = Path(path)
    doc = {"traceEvents": trace_events(steps), "displayTimeUnit": "ms", "otherData": metadata or {}}
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def _model_events(fwd: ForwardPass) -> list[dict]:
    events = []
    layers: dict[int, list] = {}
    for op in fwd.ops:
        events.append(_complete(op.name, "op", op.start_us, op.dur_us, {}))
        if op.layer is not None:
            layers.setdefault(op.layer, []).append(op)
    for layer, ops in layers.items():
        start, end = ops[0].start_us, max(o.start_us + o.dur_us for o in ops)
        kinds = sorted({o.op_type.split(".")[0] for o in ops} - {"hc"})
        events.append(_complete(f"L{layer}", "layer", start, end - start, {"ops": "+".join(kinds)}))
    return events


def _step_args(step: Step) -> dict:
    if not step.forwards:
        return {"phase": "idle"}
    shapes = [f.shape for f in step.forwards]
    requests = sum(s.num_requests for s in shapes)
    return {
        "phase": step.phase,
        "num_requests": requests,
        "num_decodes": sum(s.num_decodes for s in shapes),
        "num_prefills": sum(s.num_prefills for s in shapes),
        "num_tokens": sum(s.num_tokens for s in shapes),
        "max_context": max(s.max_context for s in shapes),
        "mean_context": sum(s.mean_context * s.num_requests for s in shapes) / requests,
    }


def _complete(name: str, cat: str, start_us: float, dur_us: float, args: dict) -> dict:
    ts = round(start_us, 3)
    dur = round(round(start_us + dur_us, 3) - ts, 3)  # end rounded like starts: nesting survives
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": PID, "tid": TID, "args": args}


def _counter(fwd: ForwardPass) -> dict:
    return {
        "name": "batch", "ph": "C", "ts": round(fwd.start_us, 3), "pid": PID, "tid": TID,
        "args": {"requests": fwd.shape.num_requests, "tokens": fwd.shape.num_tokens},
    }
