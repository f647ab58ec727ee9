"""Acceptance curves of speculative decoding on the trained default model (docs/speculative.md).

For each method (mtp, ngram) and draft length k, greedy code completion of the shipped
`code_completion` workload's prompts (held-out stdlib source), with the back-off guard off so
every decode drafts k tokens: the acceptance rate, the mean accept length (tokens per
verifying step) and, per draft position j, the share of verifies that kept draft j.

    python docs/bench/spec_acceptance.py OUT.png [--k 1,2,3,4] [--requests 8]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import oxserve.engine.scheduler as scheduler  # noqa: E402
from oxserve import LLM, SamplingParams  # noqa: E402
from oxserve.default_model import default_model  # noqa: E402
from oxserve.feedback.workload import load_workload  # noqa: E402


def measure(method: str, k: int, prompts: list[list[int]], max_tokens: int) -> dict:
    kept = Counter()  # drafts kept per verify
    spec = json.dumps({"method": method, "num_speculative_tokens": k})
    llm = LLM(speculative_config=spec)
    update = llm.engine.scheduler.update_from_output

    def tally(scheduled, output):
        for s in scheduled.scheduled:
            if s.num_draft_tokens and s.request_id in output.request_ids:
                kept[len(output.sampled_token_ids[output.request_ids.index(s.request_id)]) - 1] += 1
        return update(scheduled, output)

    llm.engine.scheduler.update_from_output = tally
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))  # fmt: skip
    stats = llm.engine.stats()
    verifies = sum(kept.values())
    return {
        "method": method, "k": k,
        "acceptance_rate": stats.spec_accepted_tokens / max(1, stats.spec_draft_tokens),
        "mean_accept_length": 1 + stats.spec_accepted_tokens / max(1, stats.spec_drafts),
        "kept_at_least": [sum(n for m, n in kept.items() if m >= j) / max(1, verifies) for j in range(1, k + 1)],
        "verifies": verifies,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--k", default="1,2,3,4")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    # the guard off, k drafts at every decode: the curve, not the guard
    scheduler.draft_depth = lambda request, k, floor: k
    scheduler.DraftCost.budget = lambda self, decodes: (0.5, 99)
    workload = load_workload("code_completion")
    prompts = [list(r.prompt_token_ids) for r in workload.requests(8192, model_dir=default_model())][: args.requests]
    rows = [measure(m, k, prompts, args.max_tokens) for m in ("mtp", "ngram") for k in map(int, args.k.split(","))]
    for row in rows:
        print(json.dumps(row))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for method, style in (("mtp", "o-"), ("ngram", "s--")):
        mine = [r for r in rows if r["method"] == method]
        left.plot([r["k"] for r in mine], [r["mean_accept_length"] for r in mine], style, label=method)
        longest = max(mine, key=lambda r: r["k"])
        right.plot(range(1, longest["k"] + 1), longest["kept_at_least"], style, label=f"{method}, k={longest['k']}")
    left.set(xlabel="draft length k", ylabel="mean accept length (tokens per verify)", title="Accept length")
    right.set(xlabel="draft position j", ylabel="share of verifies keeping draft j", title="Acceptance by position",
              ylim=(0, 1))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Trained default model, greedy code completion (held-out stdlib source)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
