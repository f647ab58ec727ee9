"""What a speculative step costs at batch 1, in one engine (docs/speculative.md, "The guard on
captured steps"): the six code_completion_b1 prompts, n-gram k drafts (default 3).

1. guard pinned to draft every step: the median `execute` time of decode-only steps by run
   length (1: plain decode; k + 1: a token and k drafts), after a warm-up request has
   recorded the shapes, and the undo of rejected drafts after sampling;
2. guard free, in a fresh engine, with and without drafts: the steps that ran as a captured
   shape's first steps do (`CapturedDecode.novelty`: met first, recording, first replay),
   their count and time, against the run's wall time.

    python docs/bench/spec_step_costs.py [k]

Single runs, not an A/B: `oxserve experiment run` measures the throughput.
"""

from __future__ import annotations

import collections
import statistics
import sys
import time

from spec_row_cost import PARAMS, guard_pinned, ngram  # (this script's folder is on the path)

from oxserve import LLM
from oxserve.default_model import default_model
from oxserve.default_model.train import held_out_windows
from oxserve.engine.capture import CapturedDecode


def pinned(prompts, k: int) -> None:
    with guard_pinned():
        llm = LLM(dtype="bfloat16", max_num_seqs=1, speculative_config=ngram(k))
        runner = llm.engine.runner
        steps, undo = collections.defaultdict(list), []
        execute, undo_rejected = runner.execute, runner._undo_rejected

        def timed_execute(out):
            start = time.perf_counter()
            result = execute(out)
            if out.num_tokens == out.num_decode_tokens:
                steps[max(s.num_draft_tokens for s in out.scheduled) + 1].append(time.perf_counter() - start)
            return result

        def timed_undo(kept):
            start = time.perf_counter()
            undo_rejected(kept)
            undo.append(time.perf_counter() - start)

        runner.execute, runner._undo_rejected = timed_execute, timed_undo
        llm.generate(prompts[:2], PARAMS)  # record the step shapes
        steps.clear(), undo.clear()
        llm.generate(prompts, PARAMS)
        for run, times in sorted(steps.items()):
            print(f"  run of {run}: {len(times):4d} steps, execute median {statistics.median(times) * 1e3:.3f} ms")
        print(f"  undo after sampling: median {statistics.median(undo) * 1e6:.0f} us")
        llm.close()


def first_steps(prompts, spec: str | None) -> None:
    novel = []
    run = CapturedDecode.run

    def noting(self, input_ids, batch, recurs=False):
        start = time.perf_counter()
        out = run(self, input_ids, batch, recurs)
        if self.novelty:
            novel.append((batch.num_tokens, self.novelty, time.perf_counter() - start))
        return out

    CapturedDecode.run = noting
    try:
        llm = LLM(dtype="bfloat16", max_num_seqs=1, speculative_config=spec)
        start = time.perf_counter()
        for prompt in prompts:
            llm.generate([prompt], PARAMS)
        wall = time.perf_counter() - start
        print(f"  {spec or 'plain'}: {len(prompts) * PARAMS.max_tokens / wall:.1f} tok/s over {wall:.3f} s; "
              f"{len(novel)} first steps of shapes took {sum(t for *_, t in novel) * 1e3:.1f} ms "
              f"({', '.join(f'{n} tok {kind} {t * 1e3:.1f}' for n, kind, t in novel)}); "
              f"guard row cost {llm.engine.scheduler.draft_cost.row_cost}")
        llm.close()
    finally:
        CapturedDecode.run = run


def main() -> None:
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    prompts = [{"prompt_token_ids": p} for p in held_out_windows(default_model(), 6, 160, 3)]
    print(f"n-gram k = {k}, guard pinned to draft every step:")
    pinned(prompts, k)
    print("guard free, a fresh engine each:")
    for spec in (None, ngram(k)):
        first_steps(prompts, spec)


if __name__ == "__main__":
    main()
