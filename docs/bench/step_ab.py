"""Two variants of a steady decode step, A and B, in one process: two engines of the default
model (bf16, 2 threads), each with BATCH greedy requests of 576 prompt tokens decoding, stepped
in alternating blocks of 25 steps (A first in even rounds, B first in odd ones). With
--output-len N the requests end after N tokens and a new batch starts (its prefill steps
included, in both arms alike), so that what a request pays when it ends is counted too. On a machine
whose runs drift +-20% from minute to minute, pairs of blocks a few milliseconds apart see the
same machine; `oxserve experiment run` compares whole runs (prefill and all) and cannot resolve
a few percent there.

Variants:
  topk         A: the indexer's pools chosen by torch.topk (as before 7c723fb); B: `top_pools`
  output-kind  A: requests want every step's output (CUMULATIVE); B: only their last (FINAL_ONLY)
  huge-pages   A: weights and caches on 4 KiB pages (OXSERVE_HUGE_PAGES=0); B: on huge pages
                  (both arms FINAL_ONLY, as the others' B)
  steady-inputs  A: every replayed step builds a ForwardBatch and copies it into its recording
                  (as before the runner's steady path); B: a steady step of plain decodes is
                  written into its recording in place (`model.batch.DecodeRows`); both FINAL_ONLY
  w8a8         A: bf16 weights; B: `--quantization w8a8`; both FINAL_ONLY

    python docs/bench/step_ab.py VARIANT BATCH [--rounds N] [--output-len N]

Prints each engine's median step time and the A/B ratio of paired blocks: its median, and a
95% interval of that median by bootstrap over the pairs.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import oxserve.model.indexer as indexer_module
from oxserve import LLM, RequestOutputKind, SamplingParams, huge_pages
from oxserve.engine.runner import ModelRunner

NATIVE_TOP_POOLS = indexer_module.top_pools
STEADY_RECORDING = ModelRunner._steady_recording


def no_steady_recording(self, size, shape, scheduled):
    return None


def torch_topk(scores, k, hidden_from=None):
    return scores.topk(k, dim=-1).indices


CUMULATIVE, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY
# variant -> {arm: (the indexer's pool choice, what requests ask for, huge pages, the steady path[, engine options])}
VARIANTS = {
    "topk": {"A": (torch_topk, CUMULATIVE, True, STEADY_RECORDING), "B": (NATIVE_TOP_POOLS, CUMULATIVE, True, STEADY_RECORDING)},
    "output-kind": {"A": (NATIVE_TOP_POOLS, CUMULATIVE, True, STEADY_RECORDING),
                    "B": (NATIVE_TOP_POOLS, FINAL_ONLY, True, STEADY_RECORDING)},
    "huge-pages": {"A": (NATIVE_TOP_POOLS, FINAL_ONLY, False, STEADY_RECORDING),
                   "B": (NATIVE_TOP_POOLS, FINAL_ONLY, True, STEADY_RECORDING)},
    "steady-inputs": {"A": (NATIVE_TOP_POOLS, FINAL_ONLY, True, no_steady_recording),
                      "B": (NATIVE_TOP_POOLS, FINAL_ONLY, True, STEADY_RECORDING)},
    "w8a8": {"A": (NATIVE_TOP_POOLS, FINAL_ONLY, True, STEADY_RECORDING),
             "B": (NATIVE_TOP_POOLS, FINAL_ONLY, True, STEADY_RECORDING, {"quantization": "w8a8"})},
}


class Arm:
    """One variant's engine and the batches it runs."""

    def __init__(self, choose_pools, kind: RequestOutputKind, huge: bool, steady_recording, options: dict, batch: int,
                 output_len: int):  # fmt: skip
        os.environ["OXSERVE_HUGE_PAGES"] = "1" if huge else "0"  # read as the engine starts
        huge_pages.available.cache_clear()
        self.llm = LLM(dtype="bfloat16", threads=2, **options)
        huge_pages.available.cache_clear()
        self.choose_pools, self.steady_recording, self.batch, self.batches = choose_pools, steady_recording, batch, 0
        self.params = SamplingParams(temperature=0.0, max_tokens=output_len or 20_000, ignore_eos=True, output_kind=kind)

    def steps(self, count: int) -> float:
        """Mean ms a step over `count` steps; the pool choice set for this engine's steps (its
        recordings are made with it, and a new shape may be recorded in any block)."""
        indexer_module.top_pools = self.choose_pools
        ModelRunner._steady_recording = self.steady_recording
        engine = self.llm.engine
        start = time.perf_counter()
        for _ in range(count):
            if not engine.has_unfinished_requests():
                for i in range(self.batch):
                    engine.add_request(f"b{self.batches}-r{i}", list(range(40 + i, 40 + i + 576)), self.params)
                self.batches += 1
            engine.step()
        return (time.perf_counter() - start) / count * 1e3


def median_interval(ratios: list[float], draws: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("variant", choices=sorted(VARIANTS))
    parser.add_argument("batch", type=int)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--output-len", type=int, default=0, help="tokens a request generates (0: it never ends)")
    args = parser.parse_args()
    arms = {arm: Arm(*setting[:4], setting[4] if len(setting) > 4 else {}, args.batch, args.output_len)
            for arm, setting in VARIANTS[args.variant].items()}  # fmt: skip
    for arm in arms.values():
        arm.steps(40)  # prefill, then the decode shapes recorded
    times: dict[str, list[float]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            times[name].append(arms[name].steps(25))
    ratios = [a / b for a, b in zip(times["A"], times["B"])]
    low, high = median_interval(ratios)
    for arm in ("A", "B"):
        print(f"{arm}: median step {statistics.median(times[arm]):.3f} ms")
    ends = f", requests of {args.output_len} tokens" if args.output_len else ""
    print(f"{args.variant}, batch {args.batch}{ends}: A/B step time {statistics.median(ratios):.3f} (95% interval of the "
          f"median [{low:.3f}, {high:.3f}], {args.rounds} pairs of 25-step blocks)")
    for arm in arms.values():
        arm.llm.close()


if __name__ == "__main__":
    main()
