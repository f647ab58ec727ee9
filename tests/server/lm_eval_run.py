"""lm-eval's `local-completions` model on one local task against a running server; writes
each request's tokens and score and each doc's acc as JSON.

    python lm_eval_run.py BASE_URL MODEL TOKENIZER_DIR TASK_DIR TASK OUT_JSON

Run in a fresh process: the Hugging Face libraries read their offline switches
(HF_HUB_OFFLINE, HF_DATASETS_OFFLINE) when first imported, and the test process has imported
them already. The requests go out as token ids (lm-eval's default with a tokenizer), so the
context/continuation boundary is lm-eval's own and the server never re-tokenizes.
"""

from __future__ import annotations

import json
import sys

from lm_eval import simple_evaluate
from lm_eval.models.openai_completions import LocalCompletionsAPI
from lm_eval.tasks import TaskManager


def main(base_url: str, model: str, tokenizer: str, task_dir: str, task: str, out: str) -> None:
    lm = LocalCompletionsAPI(base_url=f"{base_url}/v1/completions", model=model, tokenizer_backend="huggingface",
                             tokenizer=tokenizer, max_length=128, batch_size=4)  # fmt: skip
    results = simple_evaluate(model=lm, tasks=[task], task_manager=TaskManager(include_path=task_dir), log_samples=True,
                              bootstrap_iters=0)  # fmt: skip
    docs = []
    for sample in results["samples"][task]:
        requests = [
            {"tokens": lm._encode_pair(*arguments), "loglikelihood": resp[0][0], "is_greedy": resp[0][1]}
            for arguments, resp in zip(sample["arguments"], sample["resps"])
        ]
        docs.append({"doc_id": sample["doc_id"], "target": sample["target"], "acc": sample["acc"], "requests": requests})
    with open(out, "w") as f:
        json.dump({"acc": results["results"][task]["acc,none"], "docs": docs}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
