"""Where the time went: time shares by op type, layer and phase; µs per call under each
condition bucket; achieved bytes/s and FLOP/s against this machine's ceilings.

Ops are bucketed by the conditions of the step they ran in:

    phase    decode (only single-token decodes) | prefill (only prompt chunks) | mixed
    batch    requests in the step, in powers of two: 1, 2-3, 4-7, 8-15, ...
    context  mean sequence length: <256, 256-1k, 1k-4k, 4k-16k, 16k-64k, >=64k

The *gap* of a group of op calls is its measured time minus the roofline time of its
analytic bytes and FLOPs (`costs.py`): what a perfect implementation would save. The
biggest gap is the report's headline.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from oxserve.feedback.ceilings import Ceilings
from oxserve.model.config import TextModelConfig
from oxserve.profiling.costs import Storage, op_cost
from oxserve.profiling.spans import Step

PHASES = ("decode", "prefill", "mixed")
_CONTEXT_EDGES = (256, 1024, 4096, 16384, 65536)


def batch_bucket(n: int) -> str:
    lo = 1 << (max(n, 1).bit_length() - 1)
    return "1" if lo == 1 else f"{lo}-{2 * lo - 1}"


def context_bucket(tokens: float) -> str:
    names = ("<256", "256-1k", "1k-4k", "4k-16k", "16k-64k")
    for edge, name in zip(_CONTEXT_EDGES, names, strict=True):
        if tokens < edge:
            return name
    return ">=64k"


def _bucket_order(label: str) -> float:
    digits = label.lstrip("<>=").split("-")[0].replace("k", "000")
    return float(digits) + (0.5 if label.startswith(">") else 0.0)


@dataclass
class _Acc:
    """Running sums for one group of op calls."""

    calls: int = 0
    us: float = 0.0
    bytes: float = 0.0
    flops: float = 0.0
    mem_s: float = 0.0  # roofline time if only memory traffic counted
    compute_s: float = 0.0  # roofline time if only FLOPs counted
    roof_s: float = 0.0  # sum over calls of each call's roofline time (the tighter bound)
    tokens: int = 0
    modelled: bool = True

    def add(self, us: float, tokens: int, cost, ceilings: Ceilings | None) -> None:
        self.calls += 1
        self.us += us
        self.tokens += tokens
        if cost is None:
            self.modelled = False
            return
        self.bytes += cost.bytes
        self.flops += cost.flops
        if ceilings is not None:
            mem, compute = cost.bytes / ceilings.memory_bandwidth, cost.flops / ceilings.matmul_rate(cost.precision)
            self.mem_s += mem
            self.compute_s += compute
            self.roof_s += max(mem, compute)

    def roofline(self, ceilings: Ceilings | None) -> dict:
        seconds = self.us / 1e6
        out = {
            "bytes_per_call": self.bytes / self.calls,
            "flops_per_call": self.flops / self.calls,
            "achieved_bytes_per_s": self.bytes / seconds if seconds else None,
            "achieved_flops_per_s": self.flops / seconds if seconds else None,
        }
        if ceilings is None or not self.modelled or not seconds:
            return out
        out.update({
            "bound": "memory-bandwidth" if self.mem_s >= self.compute_s else "compute",
            "roofline_us": self.roof_s * 1e6,
            "roofline_fraction": self.roof_s / seconds,
            "gap_us": self.us - self.roof_s * 1e6,
        })
        return out


@dataclass
class _StepTotals:
    steps: int = 0
    us: float = 0.0
    ops: dict[str, float] = field(default_factory=lambda: defaultdict(float))


def analyse(
    steps: list[Step], cfg: TextModelConfig, elem_bytes: int, ceilings: Ceilings | None,
    layer_storage: Callable[[int], Storage] | None = None,
) -> dict:
    """Everything report.json holds except run metadata and the overhead measurement.
    `layer_storage`: how each layer is stored (quantized weights, caches; default: dense)."""
    step_us = sum(s.dur_us for s in steps)
    forward_us = sum(f.dur_us for s in steps for f in s.forwards)
    attributed_us = sum(op.dur_us for s in steps for f in s.forwards for op in f.ops)
    by_op: dict[str, _Acc] = defaultdict(_Acc)
    by_layer: dict[str, _Acc] = defaultdict(_Acc)
    by_cond: dict[tuple, _Acc] = defaultdict(_Acc)
    by_group: dict[tuple, _Acc] = defaultdict(_Acc)  # (phase, batch, op): for the gap ranking
    by_phase: dict[str, _StepTotals] = defaultdict(_StepTotals)
    phase_batch_us: dict[tuple, float] = defaultdict(float)
    for step in steps:
        phase = step.phase
        if phase is None:
            continue
        batch = batch_bucket(step.num_requests)
        context = context_bucket(max(f.shape.mean_context for f in step.forwards))
        totals = by_phase[phase]
        totals.steps += 1
        totals.us += step.dur_us
        phase_batch_us[(phase, batch)] += step.dur_us
        for fwd in step.forwards:
            for op in fwd.ops:
                storage = layer_storage(op.layer) if layer_storage and op.layer is not None else elem_bytes
                cost = op_cost(op.op_type, cfg, fwd.shape, storage)
                tokens = fwd.shape.num_tokens
                for acc in (by_op[op.op_type], by_cond[(op.op_type, phase, batch, context)],
                            by_group[(phase, batch, op.op_type)]):
                    acc.add(op.dur_us, tokens, cost, ceilings)
                by_layer[f"L{op.layer}" if op.layer is not None else op.name].add(op.dur_us, tokens, None, None)
                totals.ops[op.op_type] += op.dur_us

    return {
        "totals": {
            "steps": len(steps),
            "step_us": step_us,
            "forward_us": forward_us,
            "attributed_us": attributed_us,
            "attributed_fraction": attributed_us / forward_us if forward_us else 0.0,
        },
        "by_op": _share_rows(by_op, step_us, "op"),
        "by_layer": _share_rows(by_layer, step_us, "layer"),
        "by_phase": [
            {
                "phase": phase,
                "steps": t.steps,
                "total_us": t.us,
                "share": t.us / step_us if step_us else 0.0,
                "mean_step_us": t.us / t.steps,
                "top_ops": [
                    {"op": op, "share_of_phase": us / t.us}
                    for op, us in sorted(t.ops.items(), key=lambda kv: -kv[1])[:5]
                ],
            }
            for phase, t in sorted(by_phase.items(), key=lambda kv: PHASES.index(kv[0]))
        ],
        "by_condition": [
            {
                "op": op, "phase": phase, "batch": batch, "context": context,
                "calls": acc.calls, "total_us": acc.us, "us_per_call": acc.us / acc.calls,
                "tokens_per_call": acc.tokens / acc.calls, **acc.roofline(ceilings),
            }
            for (op, phase, batch, context), acc in sorted(
                by_cond.items(),
                key=lambda kv: (kv[0][0], PHASES.index(kv[0][1]), _bucket_order(kv[0][2]), _bucket_order(kv[0][3])),
            )
        ],
        "gaps": _gaps(by_group, phase_batch_us, ceilings),
    }


def _share_rows(accs: dict[str, _Acc], step_us: float, key: str) -> list[dict]:
    rows = [
        {key: name, "total_us": acc.us, "share": acc.us / step_us if step_us else 0.0,
         "calls": acc.calls, "us_per_call": acc.us / acc.calls}
        for name, acc in accs.items()
    ]
    return sorted(rows, key=lambda r: -r["total_us"])


def _gaps(by_group: dict[tuple, _Acc], phase_batch_us: dict[tuple, float], ceilings: Ceilings | None) -> list[dict]:
    """Groups (phase, batch bucket, op) ranked by time above their roofline, largest first."""
    if ceilings is None:
        return []
    rows = []
    for (phase, batch, op), acc in by_group.items():
        roof = acc.roofline(ceilings)
        if "gap_us" not in roof:
            continue
        rows.append({
            "phase": phase, "batch": batch, "op": op, "calls": acc.calls, "total_us": acc.us,
            "share_of_steps": acc.us / phase_batch_us[(phase, batch)], **roof,
        })
    return sorted(rows, key=lambda r: -r["gap_us"])
