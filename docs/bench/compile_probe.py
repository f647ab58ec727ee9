"""Does torch.compile (inductor) speed up decode-sized pieces of the default model on this CPU?

    python docs/bench/compile_probe.py float32|bfloat16

One thread. For the routed MoE of a sparse layer, its shared expert (a plain SwiGLU MLP) and
an mHC collapse, at decode batches 1, 4 and 16: eager and compiled (dynamic=False, one graph
per shape), each the best of 3 medians of 30 calls. Checks the compiled output against eager.
A piece that cannot be compiled says why.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

from oxserve.model.loader import load_model


def best_median_us(f, x, repeats=3, calls=30):
    best = float("inf")
    for _ in range(repeats):
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            f(x)
            times.append(time.perf_counter() - start)
        best = min(best, statistics.median(times))
    return best * 1e6


def main() -> None:
    dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "float32")
    torch.set_num_threads(1)
    model = load_model(Path.home() / ".cache/oxserve/random-model-v2", dtype=dtype).model
    layer = next(layer for layer in model.layers if layer.sparse)
    pieces = {
        "moe (routed + shared)": (layer.mlp, lambda b: torch.randn(b, 512, dtype=dtype)),
        "shared expert": (layer.mlp.shared_experts, lambda b: torch.randn(b, 512, dtype=dtype)),
        "hc.collapse": (layer.attn_hc.collapse, lambda b: torch.randn(b, 4, 512, dtype=dtype)),
    }
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    with torch.inference_mode():
        for name, (piece, make) in pieces.items():
            compiled = torch.compile(piece, dynamic=False)
            for batch in (1, 4, 16):
                x = make(batch)
                start = time.perf_counter()
                try:
                    got = compiled(x)
                except Exception as e:  # a probe: report and go on
                    print(f"{name}: does not compile in {dtype}: {str(e).splitlines()[0][:160]}")
                    break
                first = time.perf_counter() - start
                want = piece(x)
                same = all(torch.allclose(a, b, atol=tolerance, rtol=tolerance) for a, b in
                           zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)))
                eager, fast = best_median_us(piece, x), best_median_us(compiled, x)
                print(f"{name} B={batch}: eager {eager:.0f} us, compiled {fast:.0f} us, eager/compiled {eager / fast:.2f}, "
                      f"first call {first:.1f} s, same output {same}")


if __name__ == "__main__":
    main()
