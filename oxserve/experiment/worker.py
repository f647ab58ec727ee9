"""One experiment run, in a fresh process:

    python -m oxserve.experiment.worker JOB.json RESULT.json

JOB: {"options": engine options, "workload": workload dict, "threads": int | null,
      "marker_fd", "seed_fd": the pipes to the launcher (see launch.py),
      "quality": null | {"prompts", "max_tokens"}   (arm A: generate greedily, score)
                      | {"prompts", "tokens"}}      (arm B: score A's tokens)
RESULT: {"metrics": {...}, "quality": {"tokens"?, "scores"}?, "engine": {...}}

The engine is built and warmed up (one short request on a prompt of its own),
then the worker writes "R" and waits for the seed of its prompts' contents; the timed part is
making those requests and running them, and ends with "E", the outputs' length and the
outputs ([{"prompt", "output"}, ...] as JSON) written to the launcher, which times it all.

or, to check other runs' outputs (the launcher gives it the reference arm's tree):

JOB:    {"options", "threads", "verify": {"runs": {label: [{"prompt", "output"}, ...]}}}
RESULT: {"verify": {label: [the logprobs of each output's tokens under this engine, ...]}, "engine": {...}}

Only the result file says the run succeeded; errors go to stderr and a non-zero exit status.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import sys
from pathlib import Path

import torch

import oxserve
from oxserve.engine.engine import LLMEngine
from oxserve.experiment.launch import LENGTH
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

    def make_requests(token_seed: int | None):
        return workload.requests(engine.model_config.vocab_size, min_token_id=PROMPT_MIN_TOKEN_ID,
                                 model_dir=engine.model_path, token_seed=token_seed)

    first = make_requests(secrets.randbits(62))[0]  # the warm-up's own prompt: no run shares it
    run_workload(engine, [dataclasses.replace(first, sampling={**dict(first.sampling), "max_tokens": 2})],
                 Arrival(concurrency=1))
    os.write(job["marker_fd"], b"R")
    with os.fdopen(job["seed_fd"], "rb", buffering=0) as seeds:
        token_seed = int(seeds.readline())
    run = run_workload(engine, make_requests(token_seed), workload.arrival)
    outputs = json.dumps([{"prompt": list(r.prompt), "output": list(r.output)} for r in run.requests]).encode()
    with os.fdopen(job["marker_fd"], "wb") as marker:  # buffered: writes it all, then closes the pipe
        marker.write(b"E" + LENGTH.pack(len(outputs)) + outputs)
    result = {"metrics": run.metrics(), "engine": about}
    quality = job.get("quality")
    if quality:
        prompts = quality["prompts"]
        tokens = quality.get("tokens") or generate_greedy(engine, prompts, quality["max_tokens"])
        # Both arms score from the same cache state, whether or not this one generated first.
        engine.reset_prefix_cache()
        result["quality"] = {"tokens": tokens, "scores": score_tokens(engine, prompts, tokens)}
    return result


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
