"""What a draft row costs at batch 1, and what n-gram drafts buy (docs/speculative.md).

The six prompts of `code_completion_b1` (held-out stdlib source, 96 greedy tokens each), one
request at a time in one process, bf16, captured steps on:
1. plain decode: output tokens/s per request;
2. n-gram speculation (k = 3) with its guard: tokens/s per request, and the guard's own
   measurement of a draft row (`DraftCost.row_cost`, in request-steps) and drafts made;
3. n-gram with the guard pinned to draft on every step (k = 1 and k = 3): tokens/s over the
   six requests, drafts made and kept.
Not an A/B (that is `oxserve experiment run`): it says why the A/B comes out as it does.

    python docs/bench/spec_row_cost.py
"""

from __future__ import annotations

import contextlib
import time

from oxserve import LLM, SamplingParams
from oxserve.default_model import default_model
from oxserve.default_model.train import held_out_windows
from oxserve.engine import scheduler
from oxserve.engine.spec_guard import MAX_DEPTH, MIN_FLOOR

PARAMS = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)


def ngram(k: int) -> str:
    return '{"method": "ngram", "num_speculative_tokens": %d}' % k


def per_request(prompts, spec: str | None) -> None:
    llm = LLM(dtype="bfloat16", max_num_seqs=1, speculative_config=spec)
    for prompt in prompts:
        start = time.perf_counter()
        llm.generate([prompt], PARAMS)
        rate = PARAMS.max_tokens / (time.perf_counter() - start)
        stats, cost = llm.engine.stats(), llm.engine.scheduler.draft_cost
        print(f"  {rate:6.1f} tok/s  drafts {stats.spec_draft_tokens:4d} kept {stats.spec_accepted_tokens:4d}  "
              f"row cost {cost.row_cost}")
    llm.close()


@contextlib.contextmanager
def guard_pinned():
    """The speculation guard made to draft every step, as deep as k allows (restored after)."""
    budget, depth = scheduler.DraftCost.budget, scheduler.draft_depth
    scheduler.DraftCost.budget = lambda self, decodes: (MIN_FLOOR, MAX_DEPTH)
    scheduler.draft_depth = lambda request, most, floor: most
    try:
        yield
    finally:
        scheduler.DraftCost.budget, scheduler.draft_depth = budget, depth


def pinned(prompts, k: int) -> None:
    with guard_pinned():
        llm = LLM(dtype="bfloat16", max_num_seqs=1, speculative_config=ngram(k))
        llm.generate(prompts[:1], PARAMS)  # record the step shapes
        before = llm.engine.stats()
        start = time.perf_counter()
        llm.generate(prompts, PARAMS)
        rate = len(prompts) * PARAMS.max_tokens / (time.perf_counter() - start)
        after = llm.engine.stats()
        print(f"  k = {k}: {rate:6.1f} tok/s  drafts {after.spec_draft_tokens - before.spec_draft_tokens} "
              f"kept {after.spec_accepted_tokens - before.spec_accepted_tokens}")
        llm.close()


def main() -> None:
    prompts = [{"prompt_token_ids": p} for p in held_out_windows(default_model(), 6, 160, 3)]
    print("plain decode, per request:")
    per_request(prompts, None)
    print("n-gram k = 3 with its guard, per request:")
    per_request(prompts, ngram(3))
    print("n-gram, guard pinned to draft every step:")
    for k in (1, 3):
        pinned(prompts, k)


if __name__ == "__main__":
    main()
