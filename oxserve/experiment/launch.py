"""Start one worker process for one arm and read back its result.

A worker runs an arm's engine, which may be code under test (a `git:` arm the agent wrote).
So the launcher trusts nothing the worker's process could arrange on its own:

- **late prompts**: the worker builds and warms up its engine, says it is ready ("R" on a
  pipe), and only then receives the seed of its prompts' contents, drawn by the launcher at
  that moment: nothing can be computed for them ahead of the clock;
- **external clock**: the timed part runs from that seed to the moment the worker's outputs
  have arrived whole over the pipe ("E", a length, JSON), on the launcher's clock; the run's
  rate is computed from it, and a worker whose own clock disagrees fails (a slowed or
  rebound clock);
- **process check**: the worker runs under a small reaper process (a subreaper, in a session
  of its own): processes it leaves behind, even in new sessions and with a clean
  environment, are adopted by the reaper and killed; so is anything else carrying the run's
  token in its environment. A run that left any fails: it could slow the other arm's runs;
- a private temporary directory and a private copy of the native-kernel cache (`cache_dir`).

Each worker is a fork of a process that has already imported torch (forkserver.py): a run of
the smoke workload on the default model takes 2.2 s instead of 4.5, start-up included (2-core
Zen 1; docs/feedback.md), a process of its own all the same.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from oxserve.experiment.forkserver import ForkServer, wait_report

STDERR_TAIL = 2000  # characters of a failed worker's stderr kept in the error
RUN_TOKEN = "OXSERVE_WORKER_RUN"  # environment variable naming the run, inherited by its children
# The worker's own run time may differ from the launcher's by this share, plus the slack (the
# launcher's span also holds making the requests and sending the outputs).
CLOCK_TOLERANCE = 0.02
CLOCK_SLACK_S = 0.02
LENGTH = struct.Struct("!Q")  # the outputs' byte count, before them on the pipe
FORK_SERVER = ForkServer()  # workers start as forks of a process that has imported torch


class WorkerError(RuntimeError):
    """A worker failed: crashed, timed out, wrote no result or broke the launcher's rules."""


@dataclass(frozen=True)
class WorkerResult:
    result: dict
    wall_time_s: float  # the whole process, start-up included
    timed_s: float | None = None  # the timed part on the launcher's clock (None: the job runs no workload)
    outputs: list | None = None  # the timed run's outputs, as they arrived over the pipe


def source_env(source: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with `source` first on PYTHONPATH, so that a Python
    process started with it imports oxserve from that tree."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(source), env.get("PYTHONPATH")) if p)
    return env


def run_worker(source: Path, job: dict, timeout_s: float, label: str, cache_dir: Path | None = None,
               token_seed: int | None = None) -> WorkerResult:
    """Run `python -m oxserve.experiment.worker` with `source` first on the import path, so the
    engine comes from that tree (this checkout, or an exported revision). A job with a
    workload is sent `token_seed` when it is ready and timed from then; `cache_dir` becomes
    its `OXSERVE_CACHE_DIR`."""
    timed_job = "workload" in job
    with tempfile.TemporaryDirectory(prefix="oxserve-worker-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        private_tmp = Path(tmp) / "tmp"
        private_tmp.mkdir()
        token = uuid.uuid4().hex
        env = source_env(source, dict(os.environ, TMPDIR=str(private_tmp), **{RUN_TOKEN: token}))
        if cache_dir is not None:
            env["OXSERVE_CACHE_DIR"] = str(cache_dir)
        marker_read, marker_write = os.pipe()
        seed_read, seed_write = os.pipe()
        report_read, report_write = os.pipe()
        channel = _Channel(marker_read, seed_write, token_seed)
        job_path.write_text(json.dumps({**job, "marker_fd": marker_write, "seed_fd": seed_read}), encoding="utf-8")
        log_path = Path(tmp) / "stderr.log"
        start = time.perf_counter()
        # Output to a file, not a pipe: a process the worker leaves behind would hold a pipe open.
        with open(log_path, "w+", encoding="utf-8", errors="replace") as log:
            try:
                reaper = FORK_SERVER.start("oxserve.experiment.worker", [str(job_path), str(result_path)], str(source),
                                           env, log.fileno(), report_write, (marker_write, seed_read))
            except (OSError, RuntimeError):
                channel.close()
                os.close(report_read)
                raise
            finally:
                for fd in (marker_write, seed_read, report_write):  # the worker's now: EOF when it (and its children) end
                    os.close(fd)
            channel.start()
            try:
                report = wait_report(report_read, timeout_s)
            except TimeoutError as e:
                raise WorkerError(f"{label}: worker timed out after {timeout_s:.0f} s") from e
            finally:
                stray = kill_stray_processes(token)  # before the session: what outlived the worker counts
                _kill_session(reaper)
                os.close(report_read)
            wall = time.perf_counter() - start
            log.seek(0)
            stderr = log.read()
        channel.join(timeout=5.0)
        channel.close()
        report = report or {"returncode": None, "orphans": []}  # the reaper died before its report
        stray = sorted(set(stray) | set(report["orphans"]))
        if stray:
            raise WorkerError(f"{label}: left {len(stray)} process(es) running after its run (killed: "
                              f"{', '.join(map(str, stray))}); a run must not outlive its worker (process check)")
        if report["returncode"] != 0 or not result_path.exists():
            raise WorkerError(f"{label}: worker exited with status {report['returncode']}:\n{stderr[-STDERR_TAIL:].strip()}")
        result = json.loads(result_path.read_text(encoding="utf-8"))
        if not timed_job:
            return WorkerResult(result, wall)
        if channel.error:
            raise WorkerError(f"{label}: {channel.error} (external clock)")
        check_clock(label, result.get("metrics", {}).get("total_time_s"), channel.timed_s)
        return WorkerResult(result, wall, channel.timed_s, channel.outputs)


def check_clock(label: str, reported_s: float | None, timed_s: float | None) -> None:
    """The worker's own run time must agree with the launcher's (external clock)."""
    if timed_s is None:
        raise WorkerError(f"{label}: the worker did not mark its timed part: its run time cannot be checked (external clock)")
    low, high = timed_s * (1 - CLOCK_TOLERANCE) - CLOCK_SLACK_S, timed_s + CLOCK_SLACK_S
    if reported_s is None or not low <= reported_s <= high:
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


class _Channel(threading.Thread):
    """The launcher's side of the pipes: on "R" it draws nothing itself but sends the seed it
    was given and starts the clock; it stops the clock when "E" and the outputs have arrived
    whole. Anything else is a broken protocol (`error`)."""

    def __init__(self, marker_fd: int, seed_fd: int, token_seed: int | None) -> None:
        super().__init__(daemon=True)
        self.marker, self.seed_fd, self.token_seed = os.fdopen(marker_fd, "rb", buffering=0), seed_fd, token_seed
        self.timed_s: float | None = None
        self.outputs: list | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            if self.marker.read(1) != b"R":
                return self._fail("the worker did not announce it was ready")
            if self.token_seed is None:
                return self._fail("a timed job needs a token seed")
            os.write(self.seed_fd, f"{self.token_seed}\n".encode())
            start = time.perf_counter()
            if self.marker.read(1) != b"E":
                return self._fail("the worker did not end its timed part with its outputs")
            (size,) = LENGTH.unpack(self._read(LENGTH.size))
            payload = self._read(size)
            self.timed_s = time.perf_counter() - start
            self.outputs = json.loads(payload)
            if self.marker.read(1):
                self.timed_s, self.outputs = None, None
                return self._fail("the worker wrote past its outputs")
        except (OSError, ValueError, struct.error) as e:
            self._fail(f"the worker's markers are broken ({type(e).__name__}: {e})")

    def _read(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.marker.read(n - len(data))
            if not chunk:
                raise ValueError("the pipe closed early")
            data += chunk
        return data

    def _fail(self, message: str) -> None:
        self.error = self.error or message

    def close(self) -> None:
        for close in (self.marker.close, lambda: os.close(self.seed_fd)):
            try:
                close()
            except OSError:
                pass
