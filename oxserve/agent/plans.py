"""Quantization plans the agent makes with `oxserve quantize sensitivity`.

A goal's search space may list, for `quantization_plan`, plan files and markers such as
`sensitivity@0.01`: a plan the agent makes itself, by running the sensitivity command (each
layer's W8A8 and cache-dtype cost measured, the cheapest taken within the KL budget in nats
per token) on the incumbent's model and dtype. It is made once per (model, dtype, budget),
in a fresh process, as a cheap check before any experiment; the experiment then runs the
file, and the quality gate judges it like any other change.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MARKER = "sensitivity@"
OPTION = "quantization_plan"


class PlanError(ValueError):
    """The sensitivity command failed, or a marker is malformed."""


def kl_budget(value: Any) -> float | None:
    """The KL budget a `sensitivity@B` marker asks for; None for anything else."""
    if not isinstance(value, str) or not value.startswith(MARKER):
        return None
    try:
        budget = float(value[len(MARKER):])
    except ValueError:
        raise PlanError(f"{value!r}: a plan marker is {MARKER}<KL budget in nats per token>, e.g. {MARKER}0.01") from None
    if not budget > 0:
        raise PlanError(f"{value!r}: the KL budget must be > 0")
    return budget


def make_plan(options: Mapping[str, Any], budget: float, workdir: Path, timeout_s: float = 3600.0) -> Path:
    """The plan file for `options`' model and dtype within `budget`, made (or found) under
    `workdir/plans`."""
    model, dtype = options.get("model"), options.get("dtype", "bfloat16")
    key = hashlib.sha256(json.dumps([str(model), dtype, budget]).encode()).hexdigest()[:12]
    out = workdir / "plans" / key
    plan = out / "plan.yaml"
    if plan.exists():
        return plan
    command = [sys.executable, "-m", "oxserve.cli", "quantize", "sensitivity", "--dtype", str(dtype),
               "--kl-budget", str(budget), "--out", str(out)]
    if model:
        command += ["--model", str(model)]
    if options.get("threads"):
        command += ["--threads", str(options["threads"])]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise PlanError(f"oxserve quantize sensitivity took over {timeout_s:.0f} s") from e
    if done.returncode != 0 or not plan.exists():
        raise PlanError(f"oxserve quantize sensitivity failed: {done.stderr.strip()[-1500:]}")
    return plan


def concrete(options: Mapping[str, Any], base: Mapping[str, Any], workdir: Path) -> dict[str, Any]:
    """`options` with a plan marker replaced by the file it stands for (made if need be);
    `base` holds the options the plan is made under (model, dtype, threads)."""
    budget = kl_budget(options.get(OPTION))
    if budget is None:
        return dict(options)
    return {**options, OPTION: str(make_plan({**base, **options}, budget, workdir))}
