"""Speculation on sampled traffic: 16 requests sampled at temperature 0.7, top-p 0.95 (as
short_chat samples), 160 tokens each, with n-gram or MTP drafts (k = 3); prints the rate and
how many verifies, draft tokens and accepted tokens the guard let through.

    python docs/bench/spec_sampled.py LABEL [ngram|mtp]

Single runs, not an A/B (`oxserve experiment run` is).
"""

from __future__ import annotations

import sys
import time

from oxserve import LLM, SamplingParams


def main() -> None:
    label, method = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "ngram"
    llm = LLM(dtype="bfloat16", threads=2, speculative_config=f'{{"method": "{method}", "num_speculative_tokens": 3}}')
    prompts = [f"def function_{i}(x):\n    return" for i in range(16)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=8))  # warm-up
    s = llm.engine.scheduler
    drafts, tokens, accepted = s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.7, top_p=0.95, max_tokens=160, ignore_eos=True))
    wall = time.perf_counter() - start
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{label}: {n / wall:.0f} tok/s, verifies {s.num_drafts - drafts}, draft tokens {s.num_draft_tokens - tokens}, "
          f"accepted {s.num_accepted_tokens - accepted}")
    llm.close()


if __name__ == "__main__":
    main()
