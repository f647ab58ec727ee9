"""One experiment run, in a fresh process:

    python -m oxserve.experiment.worker JOB.json RESULT.json

JOB: {"options": engine options, "workload": workload dict, "threads": int | null,
      "token_seed": int | null (the prompts' contents; null: the workload's own),
      "marker_fd": int | null (a pipe to the launcher: "S" as the timed part starts, "E" as it ends),
      "quality": null | {"prompts", "max_tokens"}   (arm A: generate greedily, score)
                      | {"prompts", "tokens"}}      (arm B: score A's tokens)
RESULT: {"metrics": {...}, "outputs": [{"prompt", "output"}, ...], "quality": {"tokens"?, "scores"}?,
         "engine": {...}}

or, to check another run's outputs (the launcher gives it the reference arm's tree):

JOB:    {"options", "threads", "verify": {"runs": {label: [{"prompt", "output"}, ...]}}}
RESULT: {"verify": {label: [log-likelihood of each output under this engine, ...]}, "engine": {...}}

The engine is built and warmed up (one short request) before the clock starts; the timed
part is the workload alone, and the launcher times it too, on its own clock, from the markers.
Only the result file says the run succeeded; errors go to stderr and a non-zero exit status.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

import oxserve
from oxserve.engine.engine import LLMEngine
from oxserve.experiment.quality import generate_greedy, output_loglikelihoods, score_tokens
from oxserve.feedback.drive import PROMPT_MIN_TOKEN_ID, run_workload
from oxserve.feedback.workload import Arrival, Workload
from oxserve.options import engine_config


def run_job(job: dict) -> dict:
    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    engine = LLMEngine(engine_config(job["options"]))
    about = {"model": str(engine.model_path), "dtype": str(engine.dtype), "threads": torch.get_num_threads(),
             "source": str(Path(oxserve.__file__).resolve().parents[1])}  # which tree the engine came from
    if job.get("verify"):
        runs = job["verify"]["runs"]
        return {"verify": {label: output_loglikelihoods(engine, outputs) for label, outputs in runs.items()},
                "engine": about}
    workload = Workload.from_dict(job["workload"])
    requests = workload.requests(engine.model_config.vocab_size, min_token_id=PROMPT_MIN_TOKEN_ID,
                                 model_dir=engine.model_path, token_seed=job.get("token_seed"))
    warm = dataclasses.replace(requests[0], sampling={**dict(requests[0].sampling), "max_tokens": 2})
    run_workload(engine, [warm], Arrival(concurrency=1))
    marker = job.get("marker_fd")
    _mark(marker, b"S")
    run = run_workload(engine, requests, workload.arrival)
    _mark(marker, b"E")
    result = {
        "metrics": run.metrics(),
        "outputs": [{"prompt": list(r.prompt), "output": list(r.output)} for r in run.requests],
        "engine": about,
    }
    quality = job.get("quality")
    if quality:
        prompts = quality["prompts"]
        tokens = quality.get("tokens") or generate_greedy(engine, prompts, quality["max_tokens"])
        # Both arms score from the same cache state, whether or not this one generated first.
        engine.reset_prefix_cache()
        result["quality"] = {"tokens": tokens, "scores": score_tokens(engine, prompts, tokens)}
    return result


def _mark(fd: int | None, byte: bytes) -> None:
    if fd is not None:
        os.write(fd, byte)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m oxserve.experiment.worker JOB.json RESULT.json", file=sys.stderr)
        return 2
    job_path, result_path = map(Path, argv)
    result = run_job(json.loads(job_path.read_text(encoding="utf-8")))
    tmp = result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result), encoding="utf-8")
    os.replace(tmp, result_path)  # the result appears whole or not at all
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
