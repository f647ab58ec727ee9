"""What the engine's Python between replays costs on caches a step has just emptied: building
32 requests' outputs (`RequestOutput` with a `CompletionOutput` of 300 tokens each), timed in
a loop (hot) and after each sweep of 60 MB of memory (about what a batch-32 decode step of the
default model reads), as the engine's host work runs after each replay.

    python docs/bench/cold_host_cost.py
"""

from __future__ import annotations

import time

import numpy as np

from oxserve.outputs import CompletionOutput, RequestOutput

TOKENS = [list(range(300)) for _ in range(32)]


def outputs() -> list[RequestOutput]:
    return [RequestOutput(request_id="r", prompt=None, prompt_token_ids=t, finished=False,
                          outputs=[CompletionOutput(index=0, text="abc", token_ids=list(t), logprobs=None)],
                          metrics={"arrival_time": 1.0, "first_token_time": 2.0}) for t in TOKENS]  # fmt: skip


def main() -> None:
    step_bytes = np.ones(60 * 2**20 // 8)
    for sweep in (False, True, False, True):
        total = 0.0
        for _ in range(200):
            if sweep:
                step_bytes.sum()  # reads 60 MB, as a step's weights and states
            start = time.perf_counter()
            outputs()
            total += time.perf_counter() - start
        print(f"{'after a 60 MB sweep' if sweep else 'hot':20s} {total / 200 * 1e6:6.1f} us for 32 outputs")


if __name__ == "__main__":
    main()
