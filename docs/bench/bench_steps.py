"""The decode steps of `oxserve bench throughput`'s workload (32 prompts of 512 random tokens,
128 greedy output tokens, all in flight; bf16, 2 threads), grouped by batch size and by what
the capture did (`CapturedDecode.novelty`: "" replayed, "new" met first and eager, "settling"
recording or a first replay): count, median and total time of each group
(docs/performance.md, "Padded decode batches"); then the steps of each phase (prefill only,
mixed, decode only): count, total time, prefill and decode tokens. Extra arguments go to the
engine as `oxserve bench throughput` takes them (e.g. --compile-sizes).

    python docs/bench/bench_steps.py [engine options]
"""

from __future__ import annotations

import collections
import statistics
import sys
import time

from oxserve.bench.throughput import _random_prompts
from oxserve.cli import build_parser, engine_config_from_args
from oxserve.engine.engine import LLMEngine
from oxserve.sampling_params import SamplingParams


def main() -> None:
    argv = ["bench", "throughput", "--dtype", "bfloat16", "--threads", "2", *sys.argv[1:]]
    engine = LLMEngine(engine_config_from_args(build_parser(argv).parse_args(argv)))
    engine.add_request("warmup", _random_prompts(1, 64, engine, 1)[0], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    for i, prompt in enumerate(_random_prompts(32, 512, engine, 0)):
        engine.add_request(f"bench-{i}", prompt, params)
    groups = collections.defaultdict(list)
    phases = collections.defaultdict(lambda: [0, 0.0, 0, 0])  # steps, seconds, prefill tokens, decode tokens
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        shape = engine.last_step
        phase = phases["decode" if not shape.prefill_tokens else "mixed" if shape.decode_tokens else "prefill"]
        for i, value in enumerate((1, seconds, shape.prefill_tokens, shape.decode_tokens)):
            phase[i] += value
        if not engine.last_step.prefill_tokens:
            novelty = engine.runner.captured.novelty if engine.runner.captured else ""  # (eager: --enforce-eager)
            groups[(engine.last_step.decode_tokens, novelty)].append(seconds)
    for (batch, novelty), times in sorted(groups.items()):
        print(f"decode batch {batch:3d} {novelty or 'replayed':9s} {len(times):4d} steps, "
              f"median {statistics.median(times) * 1e3:6.2f} ms, total {sum(times) * 1e3:7.1f} ms")
    for name, (steps, seconds, prefill, decode) in phases.items():
        print(f"{name:8s} {steps:4d} steps, {seconds:6.3f} s, {prefill:6d} prefill and {decode:5d} decode tokens")


if __name__ == "__main__":
    main()
