"""report.md and report.json: the headline first, then the tables behind it."""

from __future__ import annotations

import json
from pathlib import Path

HEAVY_OPS = 6  # ops whose per-condition roofline rows are shown


def headline(analysis: dict, overhead: dict) -> list[str]:
    """Plain sentences: the biggest gap, the biggest op, what telemetry cost."""
    lines = []
    gaps = analysis["gaps"]
    if gaps:
        g = gaps[0]
        lines.append(
            f"{g['phase']}: {_op_label(g['op'])} takes {g['share_of_steps']:.0%} of step time at batch {g['batch']}, "
            f"at {g['roofline_fraction']:.1%} of the {g['bound']} roofline "
            f"({g['gap_us'] / 1e3:.1f} ms above it over {g['calls']} calls) -- the biggest gap."
        )
    else:
        lines.append("no roofline comparison (ceilings not measured).")
    if analysis["by_op"]:
        top = analysis["by_op"][0]
        lines.append(
            f"overall: {_op_label(top['op'])} is the largest op type, {top['share']:.0%} of step time "
            f"({top['us_per_call']:.0f} µs per call, {top['calls']} calls)."
        )
    phases = ", ".join(f"{p['phase']} {p['share']:.0%} ({p['steps']} steps)" for p in analysis["by_phase"])
    lines.append(f"steps by phase: {phases}; named op spans cover "
                 f"{analysis['totals']['attributed_fraction']:.1%} of forward time.")
    span = overhead["spans"]
    line = (f"telemetry: off costs {span['off_us_per_step']:.2f} µs per step ({span['off_fraction']:.3%}); "
            f"on costs {span['on_us_per_step']:.0f} µs per step ({span['on_fraction']:.2%}) for "
            f"{span['spans_per_step']:.0f} spans")
    e2e = overhead.get("end_to_end")
    if e2e:
        line += f"; end to end, traced/untraced wall time = {e2e['on_over_off']:.3f} (median of {e2e['repeats']})"
    lines.append(line + ".")
    return lines


def build_report(run: dict, analysis: dict, overhead: dict, ceilings: dict | None) -> dict:
    return {"headline": headline(analysis, overhead), "run": run, "overhead": overhead,
            "ceilings": ceilings, **analysis}


def write_report(report: dict, out_dir: Path) -> tuple[Path, Path]:
    json_path, md_path = out_dir / "report.json", out_dir / "report.md"
    json_path.write_text(json.dumps(report, indent=1), encoding="utf-8")
    md_path.write_text(render_markdown(report), encoding="utf-8")
    return md_path, json_path


def render_markdown(r: dict) -> str:
    run = r["run"]
    out = ["# oxserve profile", ""]
    out += [f"- {line}" for line in r["headline"]]
    out += ["", "## Run", "",
            f"model `{run['model']}` ({run['dtype']}, {run['device']}, {run['threads']} threads), workload `{run['workload']}`: "
            f"{run['num_requests']} requests, {run['output_tokens']} output tokens in {run['wall_s']:.2f} s "
            f"({run['output_tokens_per_s']:.1f} tok/s), {r['totals']['steps']} steps. Engine options: "
            f"`{run['engine_options']}`.", ""]
    if captured := run.get("captured_decode"):
        out += [f"Captured decode steps: {captured['replays']} forward passes replayed (their op spans time the "
                f"recorded kernel calls), {captured['captures']} recorded, {captured['eager']} other decode and verify passes eager.", ""]
    if spec := run.get("spec_decode"):
        out += [f"Speculative decoding: {spec['num_drafts']} verifying steps, {spec['num_draft_tokens']} draft tokens, "
                f"{spec['num_accepted_tokens']} accepted: acceptance rate {spec['acceptance_rate']:.3f}, "
                f"mean acceptance length {spec['mean_acceptance_length']:.2f}.", ""]
    if prefix := run.get("prefix_cache"):
        out += [f"Prefix cache: {prefix['hits']} of {prefix['queries']} prompt tokens served from the cache "
                f"(token hit rate {prefix['hit_rate']:.3f}; {prefix['hit_requests']} of {prefix['requests']} requests hit), "
                f"{prefix['checkpoints']} of {prefix['checkpoint_capacity']} KDA checkpoints held, "
                f"{prefix['checkpoint_evictions']} evicted.", ""]
    out += _table("Time by phase", ["phase", "steps", "share of step time", "mean step µs", "top ops (share of phase)"], [
        [p["phase"], p["steps"], _pct(p["share"]), f"{p['mean_step_us']:.0f}",
         ", ".join(f"{_op_label(t['op'])} {_pct(t['share_of_phase'])}" for t in p["top_ops"])]
        for p in r["by_phase"]
    ])
    out += _table("Time by op type (summed over layers)", ["op", "share of step time", "total ms", "calls", "µs per call"], [
        [_op_label(o["op"]), _pct(o["share"]), f"{o['total_us'] / 1e3:.1f}", o["calls"], f"{o['us_per_call']:.1f}"]
        for o in r["by_op"]
    ])
    out += _table("Time by layer", ["layer", "share of step time", "total ms", "op calls"], [
        [o["layer"], _pct(o["share"]), f"{o['total_us'] / 1e3:.1f}", o["calls"]] for o in r["by_layer"]
    ])
    heavy = [o["op"] for o in r["by_op"][:HEAVY_OPS]]
    rows = [c for c in r["by_condition"] if c["op"] in heavy]
    out += _table(
        f"Heaviest {len(heavy)} ops by condition: µs per call and roofline",
        ["op", "phase", "batch", "context", "calls", "µs/call", "tokens/call", "GB/s", "GFLOP/s", "bound", "of roofline"],
        [[_op_label(c["op"]), c["phase"], c["batch"], c["context"], c["calls"], f"{c['us_per_call']:.1f}",
          f"{c['tokens_per_call']:.0f}", _rate(c.get("achieved_bytes_per_s")), _rate(c.get("achieved_flops_per_s")),
          c.get("bound", "-"), _pct(c["roofline_fraction"]) if "roofline_fraction" in c else "-"]
         for c in sorted(rows, key=lambda c: heavy.index(c["op"]))],
    )
    gap_header = ["phase", "batch", "op", "share of those steps", "of roofline", "ms above roofline"]
    out += _table("Biggest gaps to the roofline", gap_header, [
        [g["phase"], g["batch"], _op_label(g["op"]), _pct(g["share_of_steps"]), _pct(g["roofline_fraction"]),
         f"{g['gap_us'] / 1e3:.1f}"]
        for g in r["gaps"][:10]
    ])
    out += _table("All ops by condition", ["op", "phase", "batch", "context", "calls", "µs/call"], [
        [_op_label(c["op"]), c["phase"], c["batch"], c["context"], c["calls"], f"{c['us_per_call']:.1f}"]
        for c in r["by_condition"]
    ])
    out += ["## How these numbers were made", "",
            "- Op times are tracer spans (`oxserve/telemetry.py`); bytes and FLOPs are the minimum analytic "
            "costs of `oxserve/profiling/costs.py` at each step's conditions; the roofline time is "
            "max(bytes / memory bandwidth, FLOPs / matmul peak) with the ceilings below. A fraction above "
            "100% means the data stayed in cache between calls.",
            f"- Ceilings: {_ceilings_line(r['ceilings'])}.",
            "- Telemetry overhead: " + _overhead_line(r["overhead"]), ""]
    return "\n".join(out)


def _table(title: str, header: list[str], rows: list[list]) -> list[str]:
    lines = [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _op_label(op: str) -> str:
    layer_free = op in ("embed", "final_norm", "lm_head")
    return op if layer_free else f"L*.{op}"


def _pct(x: float) -> str:
    return f"{x:.1%}" if x < 0.1 else f"{x:.0%}"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def _ceilings_line(c: dict | None) -> str:
    if c is None:
        return "not measured"
    return (f"{c['device']} ({c['device_name']}), memory {c['copy_bandwidth'] / 1e9:.1f} GB/s copy / "
            f"{c['read_bandwidth'] / 1e9:.1f} GB/s read, matmul {c['matmul_fp32'] / 1e9:.0f} GFLOP/s fp32, "
            f"{c['matmul_bf16'] / 1e9:.0f} GFLOP/s bf16, measured {c['measured_at']}"
            + (" (quick)" if c["quick"] else ""))


def _overhead_line(o: dict) -> str:
    s = o["spans"]
    text = (f"an empty span costs {s['span_off_ns']:.0f} ns with telemetry off and {s['span_on_ns']:.0f} ns on; "
            f"{s['spans_per_step']:.0f} spans per step against a median step of {s['median_step_us']:.0f} µs.")
    e2e = o.get("end_to_end")
    if e2e:
        text += (f" A {e2e['segment_requests']}-request segment ran {e2e['repeats']}x each way: median "
                 f"{e2e['off_median_s'] * 1e3:.1f} ms untraced, {e2e['on_median_s'] * 1e3:.1f} ms traced.")
    return text
