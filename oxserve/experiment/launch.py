"""Start one worker process for one arm and read back its result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

STDERR_TAIL = 2000  # characters of a failed worker's stderr kept in the error


class WorkerError(RuntimeError):
    """A worker failed: crashed, timed out or wrote no result."""


@dataclass(frozen=True)
class WorkerResult:
    result: dict
    wall_time_s: float  # the whole process, start-up included


def run_worker(source: Path, job: dict, timeout_s: float, label: str) -> WorkerResult:
    """Run `python -m oxserve.experiment.worker` with `source` first on the import path, so the
    engine comes from that tree (this checkout, or an exported revision)."""
    with tempfile.TemporaryDirectory(prefix="oxserve-worker-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job), encoding="utf-8")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(source), env.get("PYTHONPATH")) if p)
        start = time.perf_counter()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "oxserve.experiment.worker", str(job_path), str(result_path)],
                cwd=source, env=env, capture_output=True, text=True, timeout=timeout_s,
            )
        except subprocess.TimeoutExpired as e:
            raise WorkerError(f"{label}: worker timed out after {timeout_s:.0f} s") from e
        wall = time.perf_counter() - start
        if done.returncode != 0 or not result_path.exists():
            raise WorkerError(f"{label}: worker exited with status {done.returncode}:\n{done.stderr[-STDERR_TAIL:].strip()}")
        return WorkerResult(json.loads(result_path.read_text(encoding="utf-8")), wall)
