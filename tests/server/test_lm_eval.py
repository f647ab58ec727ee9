"""lm-eval (`local-completions`, a loglikelihood task) against a real `oxserve serve`: its
per-request log-likelihoods and per-doc acc equal what the offline API's prompt logprobs give.

lm-eval scores a continuation with `/v1/completions` and `echo: true, max_tokens: 1,
logprobs: 1, temperature: 0`, then sums `token_logprobs[ctxlen:-1]` (the last entry is the
sampled token) and calls it greedy when each token's logprob is its top one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from server_harness import serve, tiny_dense_dsa_model  # noqa: F401  (fixture)

from oxserve import LLM, SamplingParams

TASK = "oxserve_tiny_choice"
DOCS = [
    {"question": "The engine reads the prompt and", "choices": ["writes", "sleeps", "counts tokens"], "answer": 0},
    {"question": "Blocks of the cache hold", "choices": ["latents", "water", "keys and values"], "answer": 2},
    {"question": "A request that waits too long", "choices": ["is preempted", "gets a 429"], "answer": 1},
    {"question": "Tokens per step are bounded by", "choices": ["the budget", "the moon", "nothing at all"], "answer": 0},
    {"question": "Greedy decoding takes the", "choices": ["argmax", "median", "last token"], "answer": 0},
]
TOL = 1e-4  # on log-likelihoods: the server batches differently, fp32 rounding only
NEAR_TIE = 1e-3  # choices closer than this may be ranked either way by two correct runs


def write_task(directory: Path) -> None:
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    task = {
        "task": TASK, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test",
        "output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "choices",
        "doc_to_target": "answer", "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }  # fmt: skip
    (directory / f"{TASK}.yaml").write_text(yaml.safe_dump(task))


@pytest.mark.slow
def test_lm_eval_scores_equal_offline_prompt_logprobs(tiny_dense_dsa_model, tmp_path):
    model = tiny_dense_dsa_model
    write_task(tmp_path)
    out = tmp_path / "lm_eval.json"
    # Local files only: no hub, no dataset downloads, caches in tmp_path.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf")}  # fmt: skip
    runner = Path(__file__).with_name("lm_eval_run.py")
    with serve(model, log_dir=tmp_path) as server:
        subprocess.run([sys.executable, str(runner), server.base_url, str(model), str(model), str(tmp_path), TASK, str(out)],
                       env=env, check=True, timeout=120)  # fmt: skip
    report = json.loads(out.read_text())
    docs = report["docs"]
    assert sorted(d["doc_id"] for d in docs) == list(range(len(DOCS)))

    llm = LLM(model=str(model), dtype="float32", max_model_len=128)
    requests = [(r["tokens"], r) for d in docs for r in d["requests"]]
    scored = llm.generate([{"prompt_token_ids": ctx + cont} for (ctx, cont), _ in requests],
                          SamplingParams(max_tokens=1, prompt_logprobs=1))  # fmt: skip
    offline = {}
    for ((ctx, cont), r), result in zip(requests, scored):
        entries = result.prompt_logprobs[len(ctx) :]
        loglikelihood = sum(entry[token] for entry, token in zip(entries, cont))
        greedy = all(entry[token] == max(entry.values()) for entry, token in zip(entries, cont))
        assert abs(r["loglikelihood"] - loglikelihood) <= TOL, (ctx, cont)
        assert r["is_greedy"] == greedy
        offline[id(r)] = loglikelihood
    for d in docs:
        lls = sorted((offline[id(r)], i) for i, r in enumerate(d["requests"]))
        if lls[-1][0] - lls[-2][0] >= NEAR_TIE:
            assert d["acc"] == float(lls[-1][1] == d["target"]), d
    assert report["acc"] == sum(d["acc"] for d in docs) / len(docs)
