"""`oxserve bench serve` against a real server: exact output lengths, the table, the JSON line."""

from __future__ import annotations

import json
import subprocess
import sys

from server_harness import server, tiny_model  # noqa: F401  (fixtures)

KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
        "request_goodput", *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p99")))  # fmt: skip


def bench(server, *args: str) -> tuple[str, dict]:
    cmd = [sys.executable, "-m", "oxserve.cli", "bench", "serve", "--base-url", server.base_url, "--json", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads(done.stdout.strip().splitlines()[-1])


def test_bench_random_completions(server):
    out, result = bench(server, "--num-prompts", "8", "--random-input-len", "16", "--random-output-len", "6",
                        "--max-concurrency", "4", "--goodput", "ttft:600000", "e2el:600000")  # fmt: skip
    assert all(k in result for k in KEYS)
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_output_tokens"] == 8 * 6 and result["total_input_tokens"] == 8 * 16
    assert result["request_goodput"] == result["request_throughput"]
    assert 0 < result["median_ttft_ms"] <= result["p99_ttft_ms"] and result["mean_itl_ms"] > 0
    for label in ("Successful requests:", "Output token throughput (tok/s):", "P99 ITL (ms):", "Median E2EL (ms):"):
        assert label in out


def test_bench_chat_jsonl_at_a_request_rate(server, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Tell me about {w}", "output_len": n}) for w, n in [("tea", 3), ("sky", 5)]))
    _, result = bench(server, "--endpoint", "chat", "--dataset", "jsonl", "--dataset-path", str(data),
                      "--num-prompts", "4", "--request-rate", "20", "--seed", "1")  # fmt: skip
    assert result["completed"] == 4 and result["total_output_tokens"] == 3 + 5 + 3 + 5
