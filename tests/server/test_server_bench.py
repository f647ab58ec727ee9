"""`oxserve bench serve` against a real server: exact output lengths, the table, the JSON line."""

from __future__ import annotations

import json
import subprocess
import sys

from server_harness import serve, server, tiny_model  # noqa: F401  (server, tiny_model: fixtures)

KEYS = ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
        "request_goodput", *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p99")))  # fmt: skip


def bench(server, *args: str) -> tuple[str, dict]:
    cmd = [sys.executable, "-m", "oxserve.cli", "bench", "serve", "--base-url", server.base_url, "--json", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads(done.stdout.strip().splitlines()[-1])


def test_bench_random_completions(server):
    out, result = bench(server, "--num-prompts", "8", "--random-input-len", "16", "--random-output-len", "6",
                        "--max-concurrency", "4", "--goodput", "ttft:600000", "e2el:600000",
                        "--structured-output-ratio", "0.5")  # fmt: skip
    assert all(k in result for k in KEYS)
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_output_tokens"] == 8 * 6 and result["total_input_tokens"] == 8 * 16
    assert result["request_goodput"] == result["request_throughput"]
    assert 0 < result["median_ttft_ms"] <= result["p99_ttft_ms"] and result["mean_itl_ms"] > 0
    for label in ("Successful requests:", "Output token throughput (tok/s):", "P99 ITL (ms):", "Median E2EL (ms):",
                  "Mean acceptance length:"):
        assert label in out
    # Read from the server's /metrics (no speculation here: nothing drafted).
    assert result["spec_decode"] == {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                                     "acceptance_rate": 0.0, "mean_acceptance_length": 1.0}
    # Half the requests under the built-in JSON schema: the server's mask counters moved.
    assert result["structured_requests"] == 4
    assert result["grammar_mask"]["steps"] >= 6 and result["grammar_mask"]["ms_per_step"] > 0
    assert "Mask cost per such step (ms):" in out


def test_spec_decode_summary_is_the_change_over_the_run():
    from oxserve.bench.serve import spec_decode_summary

    before = {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 12}
    after = {"num_drafts": 30, "num_draft_tokens": 110, "num_accepted_tokens": 47}
    assert spec_decode_summary(before, after) == {"num_drafts": 20, "num_draft_tokens": 70, "num_accepted_tokens": 35,
                                                  "acceptance_rate": 0.5, "mean_acceptance_length": 2.75}


def test_bench_chat_jsonl_at_a_request_rate(server, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Tell me about {w}", "output_len": n}) for w, n in [("tea", 3), ("sky", 5)]))
    _, result = bench(server, "--endpoint", "chat", "--dataset", "jsonl", "--dataset-path", str(data),
                      "--num-prompts", "4", "--request-rate", "20", "--seed", "1")  # fmt: skip
    assert result["completed"] == 4 and result["total_output_tokens"] == 3 + 5 + 3 + 5


def test_bench_reports_the_prefix_cache_hit_rate(server, tmp_path):
    """One long prompt sent four times, one at a time: the second saves its state one token
    short of its end (a prompt seen whole before), the third and fourth resume there."""
    data = tmp_path / "repeat.jsonl"
    data.write_text(json.dumps({"prompt": " ".join(f"word{i}" for i in range(40)), "output_len": 2}))
    _, result = bench(server, "--dataset", "jsonl", "--dataset-path", str(data), "--num-prompts", "4", "--max-concurrency", "1")
    prefix = result["prefix_cache"]
    assert result["completed"] == 4 and prefix["queries"] > 0
    assert prefix["hits"] >= 2 * (prefix["queries"] // 4 - 1), prefix  # two requests skip all but their last token
    assert prefix["hit_rate"] == prefix["hits"] / prefix["queries"]


def test_bench_against_a_speculating_server(tiny_model, tmp_path):
    """`--speculative-config` on the real server: exact output lengths, acceptance reported."""
    with serve(tiny_model, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}', log_dir=tmp_path) as s:
        _, result = bench(s, "--num-prompts", "6", "--random-input-len", "24", "--random-output-len", "20",
                          "--max-concurrency", "3")  # fmt: skip
    assert result["completed"] == 6 and result["total_output_tokens"] == 6 * 20
    spec = result["spec_decode"]
    assert spec["num_accepted_tokens"] <= spec["num_draft_tokens"] and spec["mean_acceptance_length"] >= 1.0
