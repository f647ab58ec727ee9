"""What a steady decode step spends: the replay of its captured kernels, and the engine's
Python around it (docs/performance.md, "Padded decode batches").

BATCH requests of --context prompt tokens (576 by default) decode together (greedy, bf16, 2
threads; each step's outputs wanted, or with --final-only only the last); after 30
steady steps, 200 more are timed: the whole `LLMEngine.step`, the replay inside it, and with
--parts the engine's pieces (each wrapped in a timer, which adds a little to each).
`--compile-sizes` as the engine takes it (a batch of 17 with "17,24" runs unpadded, with the
default sizes padded to 24).

    python docs/bench/decode_step_split.py BATCH [--compile-sizes SIZES] [--parts] [--context N] [--final-only]
        [--options JSON]

Single runs, not an A/B (`oxserve experiment run` is).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import time

from call_times import steady_engine  # (this script's folder is on the path)

from oxserve.engine import capture, engine, runner, scheduler
from oxserve.model import batch as model_batch

PARTS = [(scheduler.Scheduler, "schedule"), (scheduler.Scheduler, "update_from_output"),
         (scheduler.Scheduler, "observe_step"), (engine.LLMEngine, "_output_of"), (runner, "make_forward_batch"),
         (model_batch.DecodeRows, "write"), (runner.ModelRunner, "_update_states"), (runner.ModelRunner, "_decode_size"),
         (runner.ModelRunner, "_sample"), (runner.ModelRunner, "_forward"), (runner.ModelRunner, "execute"),
         (capture.CapturedDecode, "run"), (capture.CapturedDecode, "replay_steady")]  # fmt: skip


def timed(owner, name: str, totals: collections.Counter) -> None:
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("batch", type=int)
    parser.add_argument("--compile-sizes")
    parser.add_argument("--parts", action="store_true")
    parser.add_argument("--context", type=int, default=576, help="prompt tokens a request (default: %(default)s)")
    parser.add_argument("--final-only", action="store_true", help="outputs at the end only, as LLM.generate wants them")
    parser.add_argument("--options", default="{}", help="more engine options as JSON, e.g. {\"quantization\": \"w8a8\"}")
    args = parser.parse_args()
    totals: collections.Counter = collections.Counter()
    timed(capture.StepRecording, "replay", totals)
    for owner, name in PARTS if args.parts else ():
        timed(owner, name, totals)
    llm = steady_engine(args.batch, {"compile_sizes": args.compile_sizes, **json.loads(args.options)}, args.context,
                        args.final_only)
    eng = llm.engine
    totals.clear()
    steps = 200
    start = time.perf_counter()
    for _ in range(steps):
        eng.step()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    replay_ms = totals.pop("replay") / steps * 1e3
    print(f"batch {args.batch}: step {step_ms:.2f} ms, replay {replay_ms:.2f} ms, the rest {step_ms - replay_ms:.2f} ms")
    for name, seconds in totals.most_common():
        print(f"  {name:20s} {seconds / steps * 1e6:7.1f} us a step")
    llm.close()


if __name__ == "__main__":
    main()
