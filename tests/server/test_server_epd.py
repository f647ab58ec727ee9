"""Disaggregated serving with real processes: `oxserve serve --epd-config` starts a router, an
encode, a prefill and two decode instances; answers through it equal a colocated server's
(deterministic mode: bit-equal), for text and images (encoded on the encode instance); lost
and hung instances cost no request that can be retried, and the launcher's children die with it."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import torch
import yaml

from oxserve.bench.soak_server import wait_until_serving
from oxserve.default_model import build_checkpoint
from server_harness import TINY, free_ports, serve
from vision_media import png_bytes

ARGS = ["--dtype", "float32", "--deterministic", "--max-model-len", "512", "--cache-memory-gib", "0.05"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("epd-model"), TINY, seed=4, dtype=torch.float32)


class Deployment:
    def __init__(self, proc: subprocess.Popen, port: int, members: dict[str, list[int]]):
        self.proc, self.port, self.members = proc, port, members
        self.url = f"http://127.0.0.1:{port}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0)

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/router/stats").json()

    def pid(self, port: int) -> int:
        found = subprocess.run(["pgrep", "-f", "--", f"--host 127.0.0.1 --port {port} "], capture_output=True, text=True).stdout.split()
        return int(found[0])


def _deploy(model, tmp, mode: str):
    port, encode, prefill, prefill_mm, decode_a, decode_b, kv_a, kv_b, mm_a, mm_b = free_ports(10)
    members = {"encode": [encode], "prefill": [prefill], "decode": [decode_a, decode_b]}
    config = {"model": str(model), "args": ARGS, "router": {"port": port, "disaggregate": mode}, "log_dir": str(tmp),
              "encode": [{"port": encode}], "prefill": [{"port": prefill, "mm_port": prefill_mm}],
              "decode": [{"port": decode_a, "kv_port": kv_a, "mm_port": mm_a},
                         {"port": decode_b, "kv_port": kv_b, "mm_port": mm_b}]}  # fmt: skip
    path = tmp / "epd.yaml"
    path.write_text(yaml.safe_dump(config))
    log = open(tmp / "launcher.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "oxserve.cli", "serve", "--epd-config", str(path)], stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    wait_until_serving(proc, f"http://127.0.0.1:{port}", timeout=180)
    return Deployment(proc, port, members)


def _stop(deployment: Deployment) -> None:
    if deployment.proc.poll() is None:
        deployment.proc.send_signal(signal.SIGTERM)
        deployment.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def split(model, tmp_path_factory):
    d = _deploy(model, tmp_path_factory.mktemp("epd-always"), "always")
    yield d
    _stop(d)


@pytest.fixture(scope="module")
def colocated(model, tmp_path_factory):
    with serve(model, *ARGS[2:], "--served-model-name", str(model), log_dir=tmp_path_factory.mktemp("colocated")) as s:
        yield s


def test_split_answers_equal_colocated_answers(split, colocated):
    a, b = split.client(), colocated.client()
    name = str(split.client().models.list().data[0].id)
    rng = np.random.default_rng(0)
    image = f"data:image/png;base64,{base64.b64encode(png_bytes(rng, 48, 64)).decode()}"
    for prompt in ("def parse(line):\n" * 8, "import os\n" * 30):
        kw = dict(model=name, prompt=prompt, max_tokens=10, temperature=0, logprobs=2)
        x, y = a.completions.create(**kw), b.completions.create(**kw)
        assert x.choices[0].text == y.choices[0].text and x.choices[0].logprobs.top_logprobs == y.choices[0].logprobs.top_logprobs
        assert x.usage == y.usage
    chats = [[{"role": "user", "content": "Write a for loop over a list."}],
             [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is it?"}]}]]  # fmt: skip
    for messages in chats:
        kw = dict(model=name, messages=messages, max_tokens=8, temperature=0.8, seed=5)
        x, y = a.chat.completions.create(**kw), b.chat.completions.create(**kw)
        assert x.choices[0].message.content == y.choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in a.chat.completions.create(**kw, stream=True) if c.choices)
        assert streamed == y.choices[0].message.content
    stats = split.stats()
    assert stats["split"] == 6 and stats["colocated"] == 0 and stats["handover_s"] is not None
    assert stats["encoded_elsewhere"] == 2  # the image chat's two requests: its images encoded by the encode instance
    # What cannot be handed over runs colocated: n > 1.
    two = a.completions.create(model=name, prompt="x = 1", max_tokens=3, n=2, temperature=0)
    assert len(two.choices) == 2 and split.stats()["colocated"] == 1


def test_lost_and_hung_instances(split):  # last: it takes the deployment down
    d = split
    try:
        client, name = d.client(), str(d.client().models.list().data[0].id)
        # A killed encode instance: images are encoded where their prompt runs.
        offloaded = d.stats()["encoded_elsewhere"]
        os.kill(d.pid(d.members["encode"][0]), signal.SIGKILL)
        image = f"data:image/png;base64,{base64.b64encode(png_bytes(np.random.default_rng(1), 30, 40)).decode()}"
        out = client.chat.completions.create(model=name, max_tokens=3, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}])  # fmt: skip
        assert out.choices[0].finish_reason == "length" and d.stats()["encoded_elsewhere"] == offloaded
        # A killed prefill instance: requests run colocated instead.
        os.kill(d.pid(d.members["prefill"][0]), signal.SIGKILL)
        started = time.monotonic()
        out = client.completions.create(model=name, prompt="def f(x):", max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason == "length" and time.monotonic() - started < 10
        # A decode instance hung mid-request: the request is retried on the other (nothing was streamed).
        results = {}
        worker = threading.Thread(target=lambda: results.update(
            out=client.completions.create(model=name, prompt="class A:", max_tokens=200, temperature=0, extra_body={"ignore_eos": True})))  # fmt: skip
        worker.start()
        busy = None
        for _ in range(100):
            busy = next((i for i in d.stats()["instances"] if i["kind"] == "decode" and i["in_flight"]), None)
            if busy:
                break
            time.sleep(0.02)
        assert busy is not None
        hung = d.pid(int(busy["url"].rsplit(":", 1)[1]))
        os.kill(hung, signal.SIGSTOP)
        started = time.monotonic()
        worker.join(timeout=30)
        assert not worker.is_alive() and len(results["out"].choices[0].text) > 0
        assert time.monotonic() - started < 10
        assert d.stats()["retried"] >= 1
        # The other decode instance killed mid-stream: the stream ends with an error event, promptly.
        other = next(p for p in d.members["decode"] if d.pid(p) != hung)
        body = {"model": name, "prompt": "while True:", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{d.url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            os.kill(d.pid(other), signal.SIGKILL)
            started = time.monotonic()
            rest = [line for line in lines if line.startswith("data:")]
        assert time.monotonic() - started < 10 and "instance_failed" in rest[-1]
        time.sleep(4)
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=name, prompt="y", max_tokens=2)
        assert e.value.status_code == 503 and "healthy" in json.dumps(e.value.body)
        os.kill(hung, signal.SIGCONT)
        # The launcher killed outright: its instances follow it.
        children = [d.pid(p) for p in [*d.members["decode"]] if _alive_port(d, p)]
        d.proc.kill()
        d.proc.wait()
        time.sleep(3)
        assert not any(_exists(pid) for pid in children)
    finally:
        _stop(d)


def _alive_port(d: Deployment, port: int) -> bool:
    try:
        d.pid(port)
        return True
    except IndexError:
        return False


def _exists(pid: int) -> bool:
    """A live process (not gone, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
