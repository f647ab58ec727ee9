"""Per-call cost of one bf16 product at decode sizes: F.linear, oneDNN's packed weight (the
`onednn` linear kernel) and packed panels (the `panels` kernel: AMX tiles, or AVX512-BF16
vectors on CPUs without AMX).

    python docs/bench/linear_call_cost.py            # 2 threads; median of 5 repeats of 2000 calls

Cited by docs/performance.md ("Fused decode ops and AMX products") for the per-call overhead
of oneDNN's primitive, which does not shrink with the product.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from oxserve.kernels.moe import panel_linear, panel_linear_fit, pack_linear

SHAPES = [(768, 256), (256, 64), (64, 256), (4, 256)]  # (outputs, inputs): default model's KDA projections


def per_call_us(fn, calls: int = 2000, repeats: int = 5) -> float:
    for _ in range(100):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main(threads: int) -> None:
    torch.set_num_threads(threads)
    print(f"{threads} threads; us per call")
    print(f"{'out x in':>10} {'rows':>5} {'F.linear':>9} {'onednn':>9} {'panels':>9}")
    for n, k in SHAPES:
        weight = torch.randn(n, k).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
        panels = pack_linear(weight) if panel_linear_fit(weight.device, weight.dtype, k) else None
        for rows in (1, 32):
            x = torch.randn(rows, k).bfloat16()
            plain = per_call_us(lambda: F.linear(x, weight))
            onednn = per_call_us(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
            on_panels = per_call_us(lambda: panel_linear(x, panels, n)) if panels is not None else float("nan")
            print(f"{n:>4} x {k:<4} {rows:>5} {plain:>9.1f} {onednn:>9.1f} {on_panels:>9.1f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
