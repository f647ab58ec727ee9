"""The launcher's rules for a worker, each broken on purpose by a stand-in worker (a source
tree whose `oxserve.experiment.worker` misbehaves) and each caught: a slowed clock, a process
left running, a write into the shared native-kernel cache."""

from __future__ import annotations

import json
import os
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from oxserve.experiment.launch import WorkerError, check_clock, kill_stray_processes, run_worker
from oxserve.experiment.procedure import private_cache


def worker_tree(tmp_path: Path, body: str) -> Path:
    """A source tree whose worker module runs `body` with `job`, `ready()` (announces it and
    returns the token seed), `finish(outputs)` (ends the timed part) and `done(result)`."""
    tree = tmp_path / "tree"
    (tree / "oxserve" / "experiment").mkdir(parents=True)
    (tree / "oxserve" / "__init__.py").write_text("")
    (tree / "oxserve" / "experiment" / "__init__.py").write_text("")
    (tree / "oxserve" / "experiment" / "worker.py").write_text(textwrap.dedent("""
        import json, os, struct, sys, time
        job = json.load(open(sys.argv[1]))
        result_path = sys.argv[2]
        def ready():
            os.write(job["marker_fd"], b"R")
            return int(os.fdopen(job["seed_fd"], "rb", buffering=0).readline())
        def finish(outputs):
            payload = json.dumps(outputs).encode()
            with os.fdopen(job["marker_fd"], "wb") as marker:
                marker.write(b"E" + struct.pack("!Q", len(payload)) + payload)
        def done(result):
            json.dump(result, open(result_path, "w"))
    """) + textwrap.dedent(body))
    return tree


JOB = {"workload": {}}  # a timed job (what is in it is the stand-in worker's business)


def test_an_honest_worker_is_timed_on_the_launchers_clock_and_gets_its_seed_only_when_ready(tmp_path):
    tree = worker_tree(tmp_path, """
        time.sleep(0.3)  # building the engine: not timed
        seed = ready()
        t = time.perf_counter(); time.sleep(0.3); wall = time.perf_counter() - t
        finish([{"prompt": [seed], "output": [1, 2]}])
        done({"metrics": {"total_time_s": wall}, "job": job})
    """)
    done = run_worker(tree, JOB, 60, "arm A", token_seed=123456789)
    assert 0.3 <= done.timed_s < 0.4 and done.result["metrics"]["total_time_s"] <= done.timed_s
    assert done.outputs == [{"prompt": [123456789], "output": [1, 2]}]
    assert "123456789" not in json.dumps(done.result["job"])  # the seed was not known before "R"


def test_a_worker_whose_clock_runs_slow_is_caught_by_the_external_clock(tmp_path):
    tree = worker_tree(tmp_path, """
        real = time.perf_counter
        time.perf_counter = lambda: real() * 0.9   # what a cheat in the engine could do to the harness's clock
        ready(); t = time.perf_counter(); time.sleep(0.5); wall = time.perf_counter() - t
        finish([])
        done({"metrics": {"total_time_s": wall}})
    """)
    with pytest.raises(WorkerError, match=r"arm B: the worker reported a run of 0\.4.* \(external clock\)"):
        run_worker(tree, JOB, 60, "arm B", token_seed=1)


@pytest.mark.parametrize("body, message", [
    ('done({"metrics": {"total_time_s": 1.0}})', "did not announce it was ready"),
    ('ready(); os.write(job["marker_fd"], b"X"); done({"metrics": {"total_time_s": 0.0}})', "did not end its timed part"),
    ('ready(); os.write(job["marker_fd"], b"E"); done({"metrics": {"total_time_s": 0.0}})', "markers are broken"),
    ('ready(); os.write(job["marker_fd"], b"E" + struct.pack("!Q", 2) + b"[]X"); done({"metrics": {"total_time_s": 0.0}})',
     "wrote past its outputs"),
])
def test_a_worker_that_breaks_the_marker_protocol_fails(tmp_path, body, message):
    with pytest.raises(WorkerError, match=f"{message}.*external clock"):
        run_worker(worker_tree(tmp_path, body), JOB, 60, "arm B", token_seed=1)


def test_clock_tolerance_allows_the_launchers_own_share_only():
    check_clock("A", 0.99, 1.0)
    check_clock("A", 0.97, 1.0)
    for reported in (0.9, 1.03, None):
        with pytest.raises(WorkerError, match="external clock"):
            check_clock("A", reported, 1.0)


@pytest.mark.parametrize("spawn", [
    # A new session escapes the worker's process group: the run token finds it.
    'subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)',
    # A clean environment hides the token too: the reaper adopts it when the worker exits.
    'subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True, env={})',
    # Left in the worker's own process group.
    'subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])',
])
def test_a_process_left_behind_is_killed_and_fails_the_run(tmp_path, spawn):
    pid_file = tmp_path / "child.pid"
    tree = worker_tree(tmp_path, f"""
        import subprocess
        child = {spawn}
        open({str(pid_file)!r}, "w").write(str(child.pid))
        ready(); finish([])
        done({{"metrics": {{"total_time_s": 0.0}}}})
    """)
    with pytest.raises(WorkerError, match=r"left 1 process\(es\) running .* \(process check\)"):
        run_worker(tree, JOB, 60, "arm B", token_seed=1)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
    assert kill_stray_processes("no-such-token") == []


def test_each_arm_gets_its_own_copy_of_the_native_cache(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    (shared / "native").mkdir(parents=True)
    (shared / "native" / "kernel-abc.so").write_bytes(b"trusted build")
    (shared / "some-model").mkdir()
    monkeypatch.setenv("OXSERVE_CACHE_DIR", str(shared))
    cache_b = private_cache(tmp_path / "cache-B")
    tree = worker_tree(tmp_path, """
        root = os.environ["OXSERVE_CACHE_DIR"]
        open(os.path.join(root, "native", "kernel-abc.so"), "wb").write(b"planted by B")
        done({"cache": root, "tmp": os.environ["TMPDIR"]})
    """)
    done = run_worker(tree, {}, 60, "arm B", cache_b)  # an untimed job (as the output check's)
    assert done.result["cache"] == str(cache_b) and done.result["tmp"] != os.environ.get("TMPDIR")
    assert (shared / "native" / "kernel-abc.so").read_bytes() == b"trusted build"  # A's copy is untouched
    assert (cache_b / "some-model").resolve() == shared / "some-model"  # models are shared, read-only by use


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_each_run_is_a_process_of_its_own_with_the_runs_environment(tmp_path):
    """Workers are forks of a server that has imported torch (forkserver.py): what one run does
    to the preloaded modules must not reach the next, and each must see what `python -m` in
    its tree, with its environment, would: directory, import path, temp dir, fresh seeds."""
    tree = worker_tree(tmp_path, """
        import random, sys, tempfile, torch
        import oxserve
        seen = getattr(torch, "_left_by_an_earlier_run", None)
        torch._left_by_an_earlier_run = os.getpid()
        done({"seen": seen, "pid": os.getpid(), "cwd": os.getcwd(), "path0": sys.path[0], "oxserve": oxserve.__file__,
              "tmp": tempfile.gettempdir(), "env_tmp": os.environ["TMPDIR"], "name": __name__,
              "torch_seed": torch.initial_seed(), "random": random.random()})
    """)
    first, second = (run_worker(tree, {}, 60, "arm A").result for _ in range(2))
    assert first["seen"] is None and second["seen"] is None and first["pid"] != second["pid"]
    for run in (first, second):
        assert run["cwd"] == run["path0"] == str(tree) and run["oxserve"] == str(tree / "oxserve" / "__init__.py")
        assert run["tmp"] == run["env_tmp"] != tempfile.gettempdir() and run["name"] == "__main__"
    assert first["torch_seed"] != second["torch_seed"] and first["random"] != second["random"]
