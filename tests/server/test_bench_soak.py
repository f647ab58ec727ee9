"""`oxserve bench soak` for 60 s on the tiny model (dense DSA), with a SIGKILL and a SIGTERM restart:
nothing lost or corrupted, batch lines answered once, the engine idle and its cache free at
the end. And the judge it relies on, which must catch a corrupted answer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from server_harness import MAX_MODEL_LEN, tiny_dense_dsa_model  # noqa: F401  (a fixture)

from oxserve.bench.soak_traffic import CORRUPTED, OK, Reference, judge


def test_the_judge_allows_near_ties_and_nothing_else():
    ref = Reference(["token_id:5", "token_id:9", "token_id:2"], margins=[3.0, 0.001, 2.0])
    assert judge(["token_id:5", "token_id:9", "token_id:2"], ref, 0.02) == (OK, "")
    assert judge(["token_id:5", "token_id:4", "token_id:7"], ref, 0.02)[0] == OK, "a flip at a near tie"
    assert judge(["token_id:6", "token_id:9", "token_id:2"], ref, 0.02)[0] == CORRUPTED
    assert judge(["token_id:5", "token_id:9"], ref, 0.02)[0] == CORRUPTED, "cut short"


@pytest.mark.slow
def test_a_minute_of_mixed_traffic_and_restarts_loses_nothing(tiny_dense_dsa_model, tmp_path):
    # Without top-k pool selection: on random weights the indexer's ReLU ties pools at 0, and
    # batching flips which are kept, moving logprobs by ~1e-2 (beyond the judge's tie margin).
    server_args = f"--model {tiny_dense_dsa_model} --dtype float32 --max-model-len {MAX_MODEL_LEN} --cache-memory-gib 0.05 --shutdown-timeout 5"
    cmd = [sys.executable, "-m", "oxserve.cli", "bench", "soak", "--duration", "60", "--request-rate", "3", "--kills", "1",
           "--terms", "1", "--batch-every", "5", "--server-args", server_args, "--workdir", str(tmp_path), "--json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0 and summary["passed"], summary
    assert summary["restarts"] == {"SIGKILL": 1, "SIGTERM": 1}
    assert summary["results"]["ok"] > 60 and summary["batches"]["jobs"] >= 2 and summary["batches"]["lines"] > 0
    assert all(summary["by_kind"][k] for k in ("plain", "stream", "leave", "give_up")), summary["by_kind"]
    # The heap split from /metrics is sampled next to RSS (a life cut short by a restart may have no sample).
    lives = len(summary["rss_mib"])
    assert len(summary["heap_in_use_trend_mib"]) == len(summary["heap_free_held_trend_mib"]) == lives
    assert any(trend and min(trend) > 0 for trend in summary["heap_in_use_trend_mib"]), summary["heap_in_use_trend_mib"]
