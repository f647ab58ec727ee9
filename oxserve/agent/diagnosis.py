"""The incumbent's diagnosis: `oxserve profile` run in a fresh process, read into the few
numbers the policies reason with (phase shares and step times, decode batch, op shares and
their roofline fractions, the biggest gaps, preemptions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from oxserve.experiment.launch import source_env
from oxserve.feedback.workload import Workload

PHASES = ("decode", "prefill", "mixed")


class ProfileError(RuntimeError):
    """The profile of an incumbent could not be made (the profiler failed or timed out)."""


@dataclass(frozen=True)
class Diagnosis:
    headline: tuple[str, ...]  # the profile's own first lines
    options: dict[str, Any]  # the engine options profiled (over the defaults)
    rate: float  # output tokens/s of the traced run (telemetry on: a guide, not a measurement)
    phase_share: dict[str, float]  # phase -> share of step time
    phase_step_us: dict[str, float]  # phase -> mean step time
    phase_tokens: dict[str, float]  # phase -> mean tokens per forward pass
    decode_batch: float  # mean requests per decode step
    op_share: dict[str, float]  # op type -> share of all step time
    decode_roofline: dict[str, float]  # op type -> time-weighted roofline fraction in decode steps
    gaps: tuple[dict, ...]  # the five biggest (phase, batch, op, roofline fraction, share of step time)
    preemptions: int
    threads: int
    cpus: int  # CPUs this process may use
    metrics: dict[str, float]  # the run's metrics (TTFT, TPOT, ...)
    report_dir: str
    sequences: tuple[tuple[list[int], list[int]], ...] = ()  # (prompt, output) token ids of the run's requests

    def summary(self) -> dict:
        """What the journal keeps (the token ids stay in the profile's sequences.json)."""
        return {k: v for k, v in asdict(self).items() if k != "sequences"}


def diagnose(options: Mapping[str, Any], workload: Workload, out_dir: Path, timeout_s: float = 1800.0,
             source: Path | None = None) -> Diagnosis:
    """Profile `options` on `workload` in a fresh process (as experiments measure: nothing
    warmed up in this one), writing the profile to `out_dir`; the engine comes from `source`
    (an exported revision) when given, else from this tree."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(workload.to_json())
        workload_path = f.name
    command = [sys.executable, "-m", "oxserve.cli", "profile", "--workload", workload_path, "--out", str(out_dir),
               "--overhead-repeats", "0", *option_flags(options)]
    try:
        env = source_env(source) if source is not None else None
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=source, env=env)
    except subprocess.TimeoutExpired as e:
        raise ProfileError(f"profiling took over {timeout_s:.0f} s ({' '.join(command[3:])})") from e
    finally:
        os.unlink(workload_path)
    if done.returncode != 0:
        raise ProfileError(f"profiling failed ({' '.join(command[3:])}): {done.stderr.strip()[-2000:]}")
    report = json.loads((out_dir / "report.json").read_text())
    return diagnosis_from_report(report, str(out_dir))


def diagnosis_from_report(report: Mapping[str, Any], report_dir: str = "") -> Diagnosis:
    run = report["run"]
    phase_share = {p["phase"]: p["share"] for p in report["by_phase"]}
    phase_step_us = {p["phase"]: p["mean_step_us"] for p in report["by_phase"]}
    tokens, calls = defaultdict(float), defaultdict(float)
    for row in report["by_condition"]:
        if row["op"] == "embed":  # one call per forward pass, over all its tokens
            tokens[row["phase"]] += row["calls"] * row["tokens_per_call"]
            calls[row["phase"]] += row["calls"]
    phase_tokens = {p: tokens[p] / calls[p] for p in calls if calls[p]}
    weighted, time = defaultdict(float), defaultdict(float)
    for row in report["by_condition"]:
        if row["phase"] == "decode" and row.get("roofline_fraction") is not None:
            weighted[row["op"]] += row["roofline_fraction"] * row["total_us"]
            time[row["op"]] += row["total_us"]
    total_gap = sum(g["gap_us"] for g in report["gaps"]) or 1.0
    gaps = tuple({"phase": g["phase"], "batch": g["batch"], "op": g["op"], "roofline_fraction": g["roofline_fraction"],
                  "share_of_steps": g["share_of_steps"], "share_of_gaps": g["gap_us"] / total_gap}
                 for g in report["gaps"][:5])
    return Diagnosis(
        headline=tuple(report["headline"]), options=dict(run.get("engine_options", {})),
        rate=float(run["output_tokens_per_s"]), phase_share=phase_share, phase_step_us=phase_step_us,
        phase_tokens=phase_tokens, decode_batch=phase_tokens.get("decode", 0.0),
        op_share={o["op"]: o["share"] for o in report["by_op"]},
        decode_roofline={op: weighted[op] / time[op] for op in time if time[op]},
        gaps=gaps, preemptions=int(run.get("num_preemptions", 0)), threads=int(run["threads"]),
        cpus=len(os.sched_getaffinity(0)), metrics=dict(run["metrics"]), report_dir=report_dir,
        sequences=_sequences(Path(report_dir) / "sequences.json") if report_dir else (),
    )


def _sequences(path: Path) -> tuple[tuple[list[int], list[int]], ...]:
    if not path.exists():  # a profile written before sequences.json was
        return ()
    return tuple((r["prompt"], r["output"]) for r in json.loads(path.read_text()))


def option_flags(options: Mapping[str, Any]) -> list[str]:
    """Engine options as `oxserve` command-line flags."""
    flags = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        elif value is not None:
            flags += [flag, str(value)]
    return flags
