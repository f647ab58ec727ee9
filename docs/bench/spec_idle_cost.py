"""What MTP speculation costs at batch 1 where its guard keeps drafting off: a plain engine and
an MTP engine (k = 3, guard free) alternated in one process on twelve 160-token windows of
held-out stdlib source, 96 greedy tokens each, after a warm-up that records the step shapes.

Prints both engines' output tokens/s, the guard's state afterwards (row cost per batch-size
bucket, in request-steps; at 1.0 or more it drafts only in probes) with the drafts it made,
and what the MTP engine spent a generated token in its drafter: `advance` (after every step:
each row's hidden states kept for the MTP pass it owes, and the pass over a block's positions
when the block fills), the MTP passes alone (`_run`: those, and the drafts'), and
`_settle_drafts` (passes owed by requests leaving their blocks).

    python docs/bench/spec_idle_cost.py ['{"method": "mtp", "num_speculative_tokens": 3}']

Single runs, not an A/B of builds (`oxserve experiment run` is): it says where the time of
an engine that speculates rarely goes.
"""

from __future__ import annotations

import collections
import sys
import time

from decode_step_split import timed  # (this script's folder is on the path)
from spec_row_cost import PARAMS

from oxserve import LLM
from oxserve.default_model import default_model
from oxserve.default_model.train import held_out_windows
from oxserve.engine import mtp_drafter, runner

SPENT: collections.Counter = collections.Counter()


def main() -> None:
    spec = sys.argv[1] if len(sys.argv) > 1 else '{"method": "mtp", "num_speculative_tokens": 3}'
    for owner, name in ((mtp_drafter.MTPDrafter, "advance"), (mtp_drafter.MTPDrafter, "_run"),
                        (runner.ModelRunner, "_settle_drafts")):  # fmt: skip
        timed(owner, name, SPENT)
    prompts = [{"prompt_token_ids": p} for p in held_out_windows(default_model(), 12, 160, 3)]
    llms = {"plain": LLM(dtype="bfloat16", max_num_seqs=1), "speculative": LLM(dtype="bfloat16", max_num_seqs=1, speculative_config=spec)}
    for llm in llms.values():
        for prompt in prompts[:4]:
            llm.generate([prompt], PARAMS)
    SPENT.clear()
    spent = {name: [0.0, 0] for name in llms}
    for round_ in range(3):
        for name in ("plain", "speculative") if round_ % 2 == 0 else ("speculative", "plain"):
            start = time.perf_counter()
            for prompt in prompts:
                spent[name][1] += len(llms[name].generate([prompt], PARAMS)[0].outputs[0].token_ids)
            spent[name][0] += time.perf_counter() - start
    for name, (seconds, tokens) in spent.items():
        print(f"{name}: {tokens / seconds:.1f} output tok/s")
    scheduler = llms["speculative"].engine.scheduler
    cost = {bucket: round(c, 2) for bucket, c in scheduler.draft_cost.row_cost.items()}
    print(f"guard: row cost {cost}; {scheduler.num_drafts} verifying steps, {scheduler.num_draft_tokens} drafts, "
          f"{scheduler.num_accepted_tokens} kept")
    tokens = spent["speculative"][1]
    for name, seconds in SPENT.most_common():
        print(f"  {name:16s} {seconds / tokens * 1e6:7.1f} us a generated token")
    for llm in llms.values():
        llm.close()


if __name__ == "__main__":
    main()
