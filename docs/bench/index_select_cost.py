"""What a prefill chunk's indexer selection costs on CPU, piece by piece (2 threads, index
heads 2 x 32, k = 64 pools): torch's chain (fp32 product, ReLU, head sum, mask, top-k), its
top-k alone, and the native scores (`kernels.dsa_index.index_scores`) that decode rows use
(docs/performance.md, "Tried, measured, not kept").

    python docs/bench/index_select_cost.py
"""

from __future__ import annotations

import time

import torch

from oxserve.kernels.dsa_index import index_scores


def per_call_us(f, calls: int = 50) -> float:
    for _ in range(5):
        f()
    start = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    torch.set_num_threads(2)
    for tokens, pools in ((150, 128), (900, 256), (2048, 512)):
        q, weights = torch.randn(tokens, 2, 32).bfloat16(), torch.randn(tokens, 2).bfloat16()
        keys = torch.randn(pools, 32).bfloat16()
        pos = torch.arange(tokens) + pools * 4 - tokens
        visible = torch.arange(pools).unsqueeze(0) < ((pos + 1) // 4).unsqueeze(1)

        def torch_chain():
            scores = torch.relu((q.float().reshape(-1, 32) @ keys.float().T).view(tokens, 2, -1) * 0.17)
            sums = ((weights.float() * 0.5).unsqueeze(1) @ scores).squeeze(1).masked_fill(~visible, float("-inf"))
            return sums.topk(64, dim=-1).indices

        sums = torch.randn(tokens, pools)
        tables = torch.arange(pools // 4).unsqueeze(0)
        request = torch.zeros(tokens, dtype=torch.long)
        native = lambda: index_scores(q, weights, pos, 4, request, tables, 4, keys, pools, 0.17, 0.5,  # noqa: E731
                                      hidden=float("-inf"))
        print(f"{tokens:5d} tokens x {pools:3d} pools: torch chain {per_call_us(torch_chain):7.0f} us, "
              f"its top-k {per_call_us(lambda: sums.topk(64, dim=-1)):7.0f} us, native scores {per_call_us(native):7.0f} us")


if __name__ == "__main__":
    main()
