"""What n-gram speculation spends in a fresh process at batch 1 (docs/speculative.md).

Each experiment run is a fresh worker process: the guard learns its costs again and every
new verify shape is recorded again. This runs `code_completion_b1` the way a worker does
(engine built, one 2-token warm-up request, then the workload timed), in fresh processes,
plain and n-gram (k = 3) in turn, and prints per run: tokens/s, draft rows made and kept,
steps, steps replayed, step recordings and the time spent recording them, and the guard's row cost.
Not an A/B (that is `oxserve experiment run`): it says where the time goes.

    python docs/bench/spec_fresh_process.py [RUNS_PER_ARM]
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import subprocess
import sys
import time

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3}'


def one_run(arm: str, token_seed: int) -> dict:
    from oxserve.engine.engine import LLMEngine
    from oxserve.feedback.drive import PROMPT_MIN_TOKEN_ID, run_workload
    from oxserve.feedback.workload import Arrival, load_workload
    from oxserve.options import engine_config

    options = {"dtype": "bfloat16", **({"speculative_config": NGRAM} if arm == "ngram" else {})}
    engine = LLMEngine(engine_config(options))
    workload = load_workload("code_completion_b1")

    def requests(seed: int):
        return workload.requests(engine.model_config.vocab_size, min_token_id=PROMPT_MIN_TOKEN_ID,
                                 model_dir=engine.model_path, token_seed=seed)

    first = requests(secrets.randbits(62))[0]  # the warm-up, as the experiment worker's
    run_workload(engine, [dataclasses.replace(first, sampling={**dict(first.sampling), "max_tokens": 2})],
                 Arrival(concurrency=1))
    start = time.perf_counter()
    run = run_workload(engine, requests(token_seed), workload.arrival)
    stats, captured = engine.stats(), engine.runner.captured
    return {"arm": arm, "tok_s": round(run.metrics()["output_tokens_per_s"], 1),
            "timed_s": round(time.perf_counter() - start, 2), "draft_rows": stats.spec_draft_tokens,
            "kept": stats.spec_accepted_tokens, "steps": int(run.metrics()["num_steps"]), "replayed": captured.replays,
            "recordings": captured.captures,
            "recording_s": round(captured.capture_s, 2),
            "row_cost": {bucket: round(c, 2) for bucket, c in engine.scheduler.draft_cost.row_cost.items()}}


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    for i in range(runs):
        for arm in ("plain", "ngram")[:: 1 if i % 2 == 0 else -1]:  # alternating; the same prompts in a pair
            out = subprocess.run([sys.executable, __file__, "--one", arm, str(1000 + i)], capture_output=True,
                                 text=True, check=True).stdout
            print(out.strip().splitlines()[-1])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one_run(sys.argv[2], int(sys.argv[3]))))
    else:
        main()
