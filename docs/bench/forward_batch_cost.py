"""Host-side cost of a decode step's metadata (`make_forward_batch`): block tables converted
from every request's Python list of block ids, against filled from the per-request arrays
the runner keeps (`BlockIds`). 32 decoding requests at growing contexts, block size 16.
Then plain decode steps of 1 to 64 requests at a 600-token context, their rows and pools
from per-token lists against array arithmetic (`batch.VECTOR_DECODES`).

    python docs/bench/forward_batch_cost.py      # ms per call, mean of 50 calls

Cited by docs/performance.md ("Panel kernels without AMX").
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from oxserve.default_model import default_model
from oxserve.model import batch as batch_module
from oxserve.model.batch import BatchRequest, make_forward_batch
from oxserve.model.config import TextModelConfig


def per_call_ms(requests, cfg, calls: int = 50) -> float:
    for _ in range(3):
        make_forward_batch(requests, cfg, 16, 1_000_000, "cpu")
    start = time.perf_counter()
    for _ in range(calls):
        make_forward_batch(requests, cfg, 16, 1_000_000, "cpu")
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    cfg = TextModelConfig.from_file(Path(default_model()) / "config.json")
    print(f"{'context':>8} {'batch':>6} {'from lists':>11} {'from arrays':>13}  (ms per call)")
    for context, batch in ((512, 32), (4096, 32), (16384, 32), (16384, 1)):
        blocks = context // 16 + 1
        ids = [list(range(r * blocks, (r + 1) * blocks)) for r in range(batch)]
        lists = [BatchRequest(context, 1, ids[r], r, True) for r in range(batch)]
        tensors = [BatchRequest(context, 1, ids[r], r, True, block_array=np.array(ids[r])) for r in range(batch)]
        print(f"{context:>8} {batch:>6} {per_call_ms(lists, cfg):>11.3f} {per_call_ms(tensors, cfg):>13.3f}")
    print(f"\n{'batch':>6} {'lists':>8} {'arrays':>8}  (us per call, plain decodes, context 600)")
    vector_from = batch_module.VECTOR_DECODES
    for batch in (1, 2, 4, 8, 16, 32, 64):
        ids = [np.arange(r * 64, r * 64 + 48) for r in range(batch)]
        requests = [BatchRequest(600 + r, 1, ids[r].tolist(), r, True, block_array=ids[r]) for r in range(batch)]
        batch_module.VECTOR_DECODES = 1 << 30
        lists = per_call_ms(requests, cfg, 500)
        batch_module.VECTOR_DECODES = 1
        arrays = per_call_ms(requests, cfg, 500)
        print(f"{batch:>6} {lists * 1e3:>8.1f} {arrays * 1e3:>8.1f}")
    batch_module.VECTOR_DECODES = vector_from


if __name__ == "__main__":
    main()
