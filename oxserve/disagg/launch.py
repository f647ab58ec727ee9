"""`oxserve serve --epd-config epd.yaml`: a router and its prefill and decode instances on
this host, started together and stopped together.

    model: /path/to/checkpoint        # optional: the default model
    args: ["--dtype", "bfloat16"]     # given to every instance
    router: {port: 8000, disaggregate: auto, max_stall_ms: 100}
    encode: [{port: 8051}]                                    # optional
    prefill: [{port: 8101, mm_port: 8151}]                    # mm_port: with encode instances
    decode: [{port: 8201, kv_port: 8301, mm_port: 8251, args: ["--max-num-seqs", "64"]}]

Instances run as child processes (`oxserve serve --role ...`) that the kernel stops if this
process dies (PR_SET_PDEATHSIG), so none is left behind; their logs go to `log_dir` (default:
oxserve's data directory). The router serves once every instance answers /health.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn
import yaml

from oxserve.bench.soak_server import wait_until_serving
from oxserve.disagg.router import MODES, Instance, Router, build_router_app
from oxserve.feedback.machine import data_dir

log = logging.getLogger("oxserve.epd")

START_TIMEOUT_S = 300.0
SERVING_ROLES = ("prefill", "decode")  # the roles that build the OpenAI app (and its batch store)
STOP_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Member:
    role: str  # "encode" | "prefill" | "decode"
    port: int
    kv_port: int | None
    mm_port: int | None
    args: tuple[str, ...]

    def instance(self) -> Instance:
        local = "127.0.0.1:{}".format
        return Instance(f"http://{local(self.port)}", self.role, self.kv_port and local(self.kv_port),
                        self.mm_port and local(self.mm_port))  # fmt: skip


@dataclass(frozen=True)
class Deployment:
    model: str | None
    args: tuple[str, ...]
    router_port: int
    disaggregate: str
    max_stall_s: float
    members: tuple[Member, ...]
    log_dir: Path

    @classmethod
    def load(cls, path: Path, port: int) -> Deployment:
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise SystemExit(f"--epd-config {path}: {e}") from None
        known = {"model", "args", "router", "encode", "prefill", "decode", "log_dir"}
        if not isinstance(raw, dict) or set(raw) - known:
            raise SystemExit(f"--epd-config {path}: a mapping of {sorted(known)}")
        router = raw.get("router") or {}
        members = []
        for role in ("encode", "prefill", "decode"):
            for spec in raw.get(role) or []:
                if not isinstance(spec, dict) or "port" not in spec or (role == "decode" and "kv_port" not in spec):
                    raise SystemExit(f"--epd-config {path}: each {role} instance needs a port"
                                     + (" and a kv_port" if role == "decode" else ""))  # fmt: skip
                members.append(Member(role, int(spec["port"]), spec.get("kv_port"), spec.get("mm_port"),
                                      tuple(map(str, spec.get("args", [])))))  # fmt: skip
        if not any(m.role == "decode" for m in members):
            raise SystemExit(f"--epd-config {path}: at least one decode instance")
        mode = router.get("disaggregate", "auto")
        if mode not in MODES:
            raise SystemExit(f"--epd-config {path}: router.disaggregate must be one of {MODES}")
        return cls(raw.get("model"), tuple(map(str, raw.get("args", []))), int(router.get("port", port)), mode,
                   float(router.get("max_stall_ms", 100.0)) / 1000, tuple(members),
                   Path(raw.get("log_dir") or data_dir() / "epd-logs"))  # fmt: skip


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the launcher dies, however it dies."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start(d: Deployment) -> list[tuple[Member, subprocess.Popen, Path]]:
    d.log_dir.mkdir(parents=True, exist_ok=True)
    started = []
    for m in d.members:
        cmd = [sys.executable, "-m", "oxserve.cli", "serve", "--role", m.role, "--host", "127.0.0.1", "--port", str(m.port),
               *(["--model", d.model] if d.model else []), *d.args, *m.args,
               *(["--kv-port", str(m.kv_port)] if m.kv_port is not None else []),
               *(["--mm-port", str(m.mm_port)] if m.mm_port is not None else []),
               # the deployment's own files, not a default one per port in the user's data directory
               *(["--batch-store", str(d.log_dir / f"batches-{m.role}-{m.port}.sqlite")] if m.role in SERVING_ROLES else [])]  # fmt: skip
        log_path = d.log_dir / f"{m.role}-{m.port}.log"
        with open(log_path, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        started.append((m, proc, log_path))
        log.info("epd: %s instance on port %d (pid %d), log %s", m.role, m.port, proc.pid, log_path)
    return started


def wait_healthy(started, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    for m, proc, log_path in started:
        try:
            wait_until_serving(proc, f"http://127.0.0.1:{m.port}", max(1.0, deadline - time.monotonic()))
        except RuntimeError as e:
            raise SystemExit(f"the {m.role} instance on port {m.port}: {e}; its log ({log_path}) ends:\n"
                             f"{log_path.read_text()[-2000:]}") from None  # fmt: skip


def stop(started) -> None:
    for _, proc, _ in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for _, proc, _ in started:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_deployment(path: Path, host: str, port: int) -> int:
    d = Deployment.load(path, port)
    started = start(d)
    try:
        wait_healthy(started)
        pools = {role: [m.instance() for m in d.members if m.role == role] for role in ("encode", "prefill", "decode")}
        log.info("epd: router on %s:%d over %s", host, d.router_port, ", ".join(f"{len(v)} {k}" for k, v in pools.items()))
        router = Router(pools["prefill"], pools["decode"], d.disaggregate, encode=pools["encode"], max_stall_s=d.max_stall_s)
        uvicorn.run(build_router_app(router), host=host, port=d.router_port, log_config=None)
    finally:
        stop(started)
    return 0
