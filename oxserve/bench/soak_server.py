"""The server a soak runs against: an `oxserve serve` process it starts, kills and restarts on
the same port and batch store, with its resident memory over each life."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

START_TIMEOUT_S = 600.0  # a first start may build the default model


WARM_UP_S = 30.0  # memory growth of a life is counted from its first RSS sample this long after it came up


@dataclass
class Life:
    """One run of the server process: when it came up, its RSS over time, how it ended."""

    started: float
    rss_start_mib: float
    rss_end_mib: float = 0.0
    ended_by: str = "end"  # "SIGKILL", "SIGTERM" or "end" (the soak's own stop)
    exit_code: int | None = None
    samples: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, RSS MiB)
    # From its /metrics, next to RSS: (seconds since start, heap in use MiB, free bytes malloc holds MiB, arenas)
    heap: list[tuple[float, float, float, int]] = field(default_factory=list)

    @property
    def growth_mib(self) -> float:
        """RSS at its end over RSS once warm (its start, for a life shorter than the warm-up)."""
        warm = next((rss for t, rss in self.samples if t >= WARM_UP_S), self.rss_start_mib)
        return self.rss_end_mib - warm


@dataclass
class SoakServer:
    server_args: list[str]
    workdir: Path
    port: int = 0
    lives: list[Life] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    down_since: float | None = None  # set while the server is being killed or restarted

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        if not self.port:
            self.port = _free_port()
        cmd = [sys.executable, "-m", "oxserve.cli", "serve", "--port", str(self.port), "--no-access-log",
               "--batch-store", str(self.workdir / "batches.sqlite"), *self.server_args]  # fmt: skip
        log = self.workdir / f"server-{len(self.lives)}.log"
        with open(log, "w") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_until_serving(self.proc, self.base_url, START_TIMEOUT_S)
        except RuntimeError as e:
            raise RuntimeError(f"{e}; see {log}") from None
        self.lives.append(Life(time.monotonic(), self.rss_mib()))
        self.down_since = None

    def sample(self) -> None:
        """Record the running life's RSS now."""
        life = self.lives[-1]
        if self.down_since is None and self.proc.poll() is None:
            life.samples.append((time.monotonic() - life.started, self.rss_mib()))

    def record_heap(self, metrics: dict[str, float]) -> None:
        """Record the running life's heap split from a scrape of its /metrics (no-op without it)."""
        if self.down_since is None and "oxserve:heap_in_use_bytes" in metrics:
            life = self.lives[-1]
            life.heap.append((time.monotonic() - life.started, metrics["oxserve:heap_in_use_bytes"] / 2**20,
                              metrics["oxserve:heap_free_held_bytes"] / 2**20, int(metrics["oxserve:heap_arenas"])))  # fmt: skip

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kb / 1024

    def restart(self, sig: signal.Signals, drain_timeout: float) -> int:
        """Stop the process with `sig` (SIGTERM: it drains first) and start it again; returns
        its exit code."""
        self.down_since = time.monotonic()
        life = self.lives[-1]
        life.rss_end_mib, life.ended_by = self.rss_mib(), sig.name
        self.proc.send_signal(sig)
        life.exit_code = self.proc.wait(timeout=drain_timeout + 30)
        self.start()
        return life.exit_code

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.lives[-1].rss_end_mib = self.rss_mib()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.lives[-1].exit_code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.lives[-1].exit_code = self.proc.wait()


def wait_until_serving(proc: subprocess.Popen, base_url: str, timeout: float) -> None:
    """Until the server's /health answers 200; RuntimeError if it exits or takes longer."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} while starting")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not come up in {timeout:.0f} s")
        time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
