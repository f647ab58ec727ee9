"""Start one worker process for one arm and read back its result.

A worker runs an arm's engine, which may be code under test (a `git:` arm the agent wrote).
So the launcher trusts nothing the worker's process could arrange on its own:

- it times the workload itself, on its own clock, from two markers the worker writes to a
  pipe as the timed part starts and ends; a reported run time that disagrees with it fails
  the run (a worker whose clock was slowed or rebound);
- the worker runs in a session of its own with a private temporary directory and a private
  copy of the native-kernel cache (`cache_dir`), so nothing it writes there reaches the
  other arm's runs;
- when it ends, every process that carries its run token (inherited through the
  environment) is killed, and a run that left any behind fails: a process outliving its run
  could slow the other arm's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

STDERR_TAIL = 2000  # characters of a failed worker's stderr kept in the error
RUN_TOKEN = "OXSERVE_WORKER_RUN"  # environment variable naming the run, inherited by its children
# A worker's own run time may fall short of the launcher's by this share, plus the slack:
# the markers are written just outside the worker's clock, and the pipe adds microseconds.
CLOCK_TOLERANCE = 0.05
CLOCK_SLACK_S = 0.05


class WorkerError(RuntimeError):
    """A worker failed: crashed, timed out, wrote no result or broke the launcher's rules."""


@dataclass(frozen=True)
class WorkerResult:
    result: dict
    wall_time_s: float  # the whole process, start-up included
    timed_s: float | None = None  # the timed part, on the launcher's clock (None: the job runs no workload)


def run_worker(source: Path, job: dict, timeout_s: float, label: str, cache_dir: Path | None = None) -> WorkerResult:
    """Run `python -m oxserve.experiment.worker` with `source` first on the import path, so the
    engine comes from that tree (this checkout, or an exported revision). `cache_dir` becomes
    its `OXSERVE_CACHE_DIR`."""
    with tempfile.TemporaryDirectory(prefix="oxserve-worker-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        private_tmp = Path(tmp) / "tmp"
        private_tmp.mkdir()
        token = uuid.uuid4().hex
        env = dict(os.environ, TMPDIR=str(private_tmp), **{RUN_TOKEN: token})
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(source), env.get("PYTHONPATH")) if p)
        if cache_dir is not None:
            env["OXSERVE_CACHE_DIR"] = str(cache_dir)
        read_end, write_end = os.pipe()
        timer = _MarkerTimer(read_end)
        job_path.write_text(json.dumps({**job, "marker_fd": write_end}), encoding="utf-8")
        log_path = Path(tmp) / "stderr.log"
        start = time.perf_counter()
        # Output to a file, not a pipe: a process the worker leaves behind would hold a pipe open.
        with open(log_path, "w+", encoding="utf-8", errors="replace") as log:
            try:
                process = subprocess.Popen(
                    [sys.executable, "-m", "oxserve.experiment.worker", str(job_path), str(result_path)],
                    cwd=source, env=env, stdout=log, stderr=log, pass_fds=(write_end,), start_new_session=True,
                )
            finally:
                os.close(write_end)  # the worker holds the only write end: EOF when it (and its children) end
            timer.start()
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired as e:
                raise WorkerError(f"{label}: worker timed out after {timeout_s:.0f} s") from e
            finally:
                _kill_session(process.pid)
                process.wait()
                stray = kill_stray_processes(token)
            wall = time.perf_counter() - start
            log.seek(0)
            stderr = log.read()
        timer.join(timeout=5.0)
        if stray:
            raise WorkerError(f"{label}: left {len(stray)} process(es) running after its run (killed: "
                              f"{', '.join(map(str, stray))}); a run must not outlive its worker (process check)")
        if process.returncode != 0 or not result_path.exists():
            raise WorkerError(f"{label}: worker exited with status {process.returncode}:\n{stderr[-STDERR_TAIL:].strip()}")
        result = json.loads(result_path.read_text(encoding="utf-8"))
        timed = timer.span_s()
        if "metrics" in result:
            check_clock(label, result["metrics"].get("total_time_s"), timed)
        return WorkerResult(result, wall, timed)


def check_clock(label: str, reported_s: float | None, timed_s: float | None) -> None:
    """The worker's own run time must agree with the launcher's (external clock)."""
    if timed_s is None:
        raise WorkerError(f"{label}: the worker did not mark its timed part: its run time cannot be checked (external clock)")
    if reported_s is None or not (timed_s * (1 - CLOCK_TOLERANCE) - CLOCK_SLACK_S <= reported_s <= timed_s + CLOCK_SLACK_S):
        raise WorkerError(f"{label}: the worker reported a run of {reported_s} s but the launcher timed {timed_s:.3f} s: "
                          f"its clock disagrees with the harness's (external clock)")


def kill_stray_processes(token: str) -> list[int]:
    """Kill every process whose environment carries `token`; their pids."""
    needle = f"{RUN_TOKEN}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if needle in environ.split(b"\0"):
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                found.append(int(entry.name))
            except ProcessLookupError:
                pass
    return found


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _MarkerTimer(threading.Thread):
    """Reads the worker's markers and stamps them with this process's clock."""

    def __init__(self, fd: int) -> None:
        super().__init__(daemon=True)
        self.fd = fd
        self.stamps: dict[bytes, float] = {}

    def run(self) -> None:
        try:
            while chunk := os.read(self.fd, 64):
                now = time.perf_counter()
                for byte in chunk:
                    self.stamps.setdefault(bytes([byte]), now)
        finally:
            os.close(self.fd)

    def span_s(self) -> float | None:
        if b"S" in self.stamps and b"E" in self.stamps:
            return self.stamps[b"E"] - self.stamps[b"S"]
        return None
