"""Worker processes forked from a parent that has already imported torch.

Importing torch takes ~3.5 s of a run's ~4.5 s on a small model (2-core Zen 1), and every
experiment run is a fresh process. The fork server imports torch once; each run is then a
fork of it that takes on the run's working directory, environment, import path and pipes
and runs the worker module as `python -m` would. A run still gets a process of its own
(nothing it does in memory reaches the next run), under a subreaper in a session of its own,
as before.

The server runs as a script (`python forkserver.py CONTROL_FD`, no PYTHONPATH): it imports
the standard library and the preloaded libraries, never oxserve, whose code each run brings
from its own tree. What a fork shares with its siblings, unlike fresh processes: the Python
hash seed (string-keyed sets iterate in one order), and whatever torch computed on import;
random generators are reseeded in each run.

Protocol, one message per request on a SOCK_SEQPACKET socket: the launcher sends a JSON
request with its file descriptors attached (the run's log, the pipe its report comes back on,
then the descriptors the worker keeps); the server answers {"pid": the run's reaper}. When the
worker has exited and the reaper has killed what it left behind, the reaper writes its report
({"returncode", "orphans"}) on the report pipe and exits.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

PRELOAD = ("torch",)  # what every worker imports first, and most of its start-up
MAX_MESSAGE = 1 << 20
PR_SET_CHILD_SUBREAPER = 36
# Variables the server's imports cannot read, left out of its environment (a run gets its own
# whole): the import path, oxserve's own (it never imports oxserve), and pytest's, which
# changes with every test and would restart the server each time.
RUN_ENV_PREFIXES = ("PYTHONPATH", "OXSERVE_", "PYTEST_")


# ---- the launcher's side ---------------------------------------------------------------------


class ForkServer:
    """One server process, started on first use and again if it died, the launcher's
    environment changed (libraries read some variables on import) or the launcher is a fork
    of the process that started it (the two would share one socket). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._control: socket.socket | None = None
        self._env: dict[str, str] | None = None
        self._owner = os.getpid()

    def start(self, module: str, args: list[str], cwd: str, env: dict[str, str], log_fd: int, report_fd: int,
              keep_fds: tuple[int, ...]) -> int:
        """Fork a run of `python -m module *args` in `cwd` with `env`, stdout and stderr to
        `log_fd`, its report to `report_fd`, and `keep_fds` open under the same numbers.
        Returns the reaper's pid (its process group holds the run)."""
        request = json.dumps({"module": module, "args": args, "cwd": cwd, "env": env, "keep_fds": list(keep_fds)})
        with self._lock:
            for _ in range(2):
                control = self._ensure()
                try:
                    socket.send_fds(control, [request.encode()], [log_fd, report_fd, *keep_fds])
                    reply = control.recv(MAX_MESSAGE)
                except OSError:
                    reply = b""
                if reply:
                    return int(json.loads(reply)["pid"])
                self._stop()  # died: start a fresh one, once
        raise RuntimeError("the experiment fork server exited; see its output above")

    def _ensure(self) -> socket.socket:
        env = {k: v for k, v in os.environ.items() if not k.startswith(RUN_ENV_PREFIXES)}
        if self._owner != os.getpid():  # a forked launcher: the server is its parent's (closing our copy of the socket)
            if self._control is not None:
                self._control.close()
            self._process, self._control, self._env, self._owner = None, None, None, os.getpid()
        if self._process is not None and (self._process.poll() is not None or env != self._env):
            self._stop()
        if self._process is None:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._process = subprocess.Popen([sys.executable, __file__, str(theirs.fileno())], env=env, cwd="/",
                                             stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                                             start_new_session=True)  # a ctrl-C meant for the launcher spares it
            theirs.close()
            self._control, self._env = ours, env
        assert self._control is not None
        return self._control

    def _stop(self) -> None:
        if self._control is not None:
            self._control.close()  # the server exits on end-of-file
        if self._process is not None:
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process, self._control, self._env = None, None, None


def wait_report(report_fd: int, timeout_s: float) -> dict | None:
    """The reaper's report, read until it closes the pipe; None if it exited without one.
    Raises TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([report_fd], [], [], left)[0]:
            raise TimeoutError
        chunk = os.read(report_fd, 65536)
        if not chunk:
            return json.loads(data) if data else None
        data += chunk


# ---- the server's side (a process of its own) ------------------------------------------------


def serve(control: socket.socket) -> None:
    for name in PRELOAD:
        __import__(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # reapers are reaped by the kernel: each reports on its pipe
    while True:
        message, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, 64)
        if not message:
            return  # the launcher is gone
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            control.close()
            _reap(request, *fds)  # never returns
        for fd in fds:
            os.close(fd)
        control.send(json.dumps({"pid": pid}).encode())


def _reap(request: dict, log_fd: int, report_fd: int, *keep: int) -> None:
    """The reaper: a session of its own, subreaper of everything the worker starts. Ends with
    os._exit: what the server's stack would do on its way out is not its business."""
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        worker = os.fork()
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    if worker == 0:
        os.close(report_fd)
        _become_worker(request, log_fd, keep)  # SystemExit: the interpreter ends when the module does
    try:
        os.close(log_fd)
        for fd in keep:
            os.close(fd)
        code = os.waitstatus_to_exitcode(os.waitpid(worker, 0)[1])
        report = {"returncode": code, "orphans": sorted(_kill_orphans())}
        os.write(report_fd, json.dumps(report).encode())
    finally:
        os._exit(0)


def _kill_orphans() -> set[int]:
    """Kill what the worker left behind: as a subreaper this process adopts its orphans (and
    theirs, as each dies), until none is left."""
    orphans: set[int] = set()
    for _ in range(100):
        found = _children()
        if not found:
            break
        orphans.update(found)
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
    return orphans


def _children() -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue
            if int(ppid) == os.getpid() and state != "Z":
                found.append(int(entry))
    return found


def _become_worker(request: dict, log_fd: int, keep: tuple[int, ...]) -> None:
    """What `python -m module args` started in `cwd` with `env` would be, in this process."""
    import random
    import runpy
    import tempfile

    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    clear = max([2, *keep, *request["keep_fds"]]) + 1  # above every number in play
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, clear) for fd in keep]
    for fd in keep:
        os.close(fd)
    for fd, target in zip(moved, request["keep_fds"]):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # gettempdir() reads the run's TMPDIR again
    paths = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:1] = [request["cwd"], *paths]  # in place of the server's script directory
    random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = ["-m", *request["args"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
