"""Where an MTP-speculating step's time goes at batch 1 (docs/speculative.md, "MTP on captured
steps"): six 160-token windows of held-out stdlib source (as `spec_row_cost.py`), 96 greedy
tokens each, one request at a time in one engine, bf16.

Plain decode, then MTP speculation with the guard pinned to draft k tokens at every step
(k = 1, 2, 3), after a warm-up pass over the prompts that records the step shapes. Per
engine: output tokens/s, steps, tokens per step, drafts kept, and per step the time of the
target's forward (`ModelRunner._forward`), of the MTP passes (`MTPDrafter._run`, their count
a step) and of the whole engine step.

    python docs/bench/mtp_step_costs.py

Single runs, not an A/B (that is `oxserve experiment run`): it says why the A/B comes out as
it does.
"""

from __future__ import annotations

import collections
import contextlib
import time

from spec_row_cost import PARAMS, guard_pinned  # (this script's folder is on the path)

from oxserve import LLM
from oxserve.default_model import default_model
from oxserve.default_model.train import held_out_windows


def timed(obj, name: str, seconds: dict, calls: collections.Counter) -> None:
    """Wrap `obj.name` to add its wall time and calls to `seconds` and `calls`."""
    function = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - start
            calls[name] += 1

    setattr(obj, name, wrapper)


def run(prompts, k: int) -> None:
    spec = '{"method": "mtp", "num_speculative_tokens": %d}' % k if k else None
    with guard_pinned() if k else contextlib.nullcontext():
        llm = LLM(dtype="bfloat16", max_num_seqs=1, speculative_config=spec)
        llm.generate(prompts, PARAMS)  # record the step shapes
        engine, seconds, calls = llm.engine, collections.defaultdict(float), collections.Counter()
        timed(engine, "step", seconds, calls)
        timed(engine.runner, "_forward", seconds, calls)
        if k:
            timed(engine.runner.drafter, "_run", seconds, calls)
        before = engine.stats()
        start = time.perf_counter()
        for prompt in prompts:
            llm.generate([prompt], PARAMS)
        wall = time.perf_counter() - start
        stats, steps = engine.stats(), calls["step"]
        tokens = PARAMS.max_tokens * len(prompts)
        drafted = stats.spec_draft_tokens - before.spec_draft_tokens
        kept = stats.spec_accepted_tokens - before.spec_accepted_tokens
        print(f"{'plain' if not k else f'MTP k={k}':9s} {tokens / wall:6.1f} tok/s  {steps:4d} steps "
              f"{tokens / steps:4.2f} tok/step  kept {kept:4d}/{drafted:<4d}  per step: "
              f"forward {1e3 * seconds['_forward'] / steps:5.2f} ms, MTP {calls['_run'] / steps:3.1f} passes "
              f"{1e3 * seconds['_run'] / steps:5.2f} ms, step {1e3 * seconds['step'] / steps:5.2f} ms")
        llm.close()


def main() -> None:
    prompts = [{"prompt_token_ids": p} for p in held_out_windows(default_model(), 6, 160, 3)]
    for k in (0, 1, 2, 3):
        run(prompts, k)


if __name__ == "__main__":
    main()
