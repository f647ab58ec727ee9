"""The server tests' harness: tiny float32 checkpoints and real `oxserve serve` processes.

Test modules import the fixtures they use from here. (A conftest.py in this folder would be
imported as module `conftest` too and shadow tests/conftest.py for tests that import it.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from oxserve.bench.soak_server import wait_until_serving
from oxserve.default_model import build_checkpoint, make_text_config

# 3 KDA layers + 1 MLA/DSA layer, dense and MoE MLPs: every code path, a few ms per step.
TINY = make_text_config(
    vocab_size=8192, hidden_size=64, num_hidden_layers=4, intermediate_size=96, n_routed_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16, index_n_heads=2, index_head_dim=16,
    index_topk=8, index_kpool=4, linear_num_heads=2, linear_head_dim=16,
)  # fmt: skip
MAX_MODEL_LEN = 128
# The agent-facing server: GLM tool calls and reasoning read out of chat outputs, room for tools in the prompt.
AGENT_ARGS = ("--tool-call-parser", "glm", "--enable-auto-tool-choice", "--reasoning-parser", "glm", "--max-model-len", "640")


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path):
        self.proc = proc
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path

    def client(self, **kwargs) -> openai.OpenAI:
        # No retries: a 429 or 503 must reach the test, not be retried away.
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of /metrics by name (e.g. 'oxserve:num_preemptions_total')."""
        text = httpx.get(f"{self.base_url}/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}

    def log(self) -> str:
        return self.log_path.read_text()


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` different ports nothing listens on now (asked for one at a time, the kernel may
    hand out a just-released port again)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@contextmanager
def serve(model: Path, *args: str, log_dir: Path, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """Runs `oxserve serve` on a free port until the block ends (`env`: extra environment variables);
    fails with its log if it never comes up."""
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    cmd = [sys.executable, "-m", "oxserve.cli", "serve", "--model", str(model), "--dtype", "float32",
           "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), "--cache-memory-gib", "0.05",
           "--batch-store", str(log_dir / f"batches-{port}.sqlite"), *args]  # fmt: skip
    with open(log_path, "w") as log:
        environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=environment)
    server = ServerProcess(proc, port, log_path)
    try:
        try:
            wait_until_serving(proc, server.base_url, timeout=120)
        except RuntimeError as e:
            raise RuntimeError(f"{e}:\n{server.log()}") from None
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.send_signal(signal.SIGINT)  # the second one skips draining
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-model"), TINY, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_dense_dsa_model(tmp_path_factory) -> Path:
    """TINY whose sparse attention keeps every token up to MAX_MODEL_LEN: no top-k selection.

    The DSA indexer scores pools through a ReLU, so on random weights many pools tie at
    exactly 0; batching moves such scores by an ulp and flips which pools are kept, which
    moves logprobs by ~1e-2. Tests that compare batched against alone numerics within
    float tolerances use this model; bitwise tests use TINY.
    """
    return build_checkpoint(tmp_path_factory.mktemp("tiny-dense-dsa"), {**TINY, "index_topk": MAX_MODEL_LEN}, dtype=torch.float32)


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory) -> Iterator[ServerProcess]:
    """A server with default options (shared: tests must leave it idle)."""
    with serve(tiny_model, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s
