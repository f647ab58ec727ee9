"""The W8A8 microbenchmark behind docs/quantization.md: one linear layer's product at decode
row counts, fp32 `F.linear` against the native W8A8 kernel, one thread; and `torch._int_mm`,
which the kernel does not use on CPU. Also a large fp32 matmul, the core's arithmetic peak.

    python docs/bench/w8a8_matmul.py
"""

import time

import torch
import torch.nn.functional as F

from oxserve.kernels.int8 import (
    column_multiple,
    pad_columns,
    quantize_weight,
    w8a8_grouped,
)


def ms(fn, reps: int = 30) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    torch.set_num_threads(1)
    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
    print(f"fp32 matmul 512x1024x1024: {2 * 512 * 1024 * 1024 / ms(lambda: a @ b) / 1e6:.1f} GFLOP/s")
    print("rows  N x K        fp32 F.linear  W8A8 kernel  int8 weight GB/s  G multiply-adds/s  torch._int_mm")
    for rows in (1, 8, 32):
        for n, k in ((2048, 512), (4096, 1024)):
            x, w = torch.randn(rows, k), torch.randn(n, k)
            q, scale = quantize_weight(w[None])
            packed, offsets = pad_columns(q, column_multiple()), torch.tensor([rows], dtype=torch.int32)
            dense = ms(lambda: F.linear(x, w))
            int8 = ms(lambda: w8a8_grouped(x, offsets, packed, scale))
            xq = torch.randint(-127, 128, (max(rows, 17), k), dtype=torch.int8)  # _int_mm wants > 16 rows
            wt = q[0].t()
            int_mm = ms(lambda: torch._int_mm(xq, wt), reps=3)
            print(f"{rows:4d}  {n}x{k:<6d}  {dense:10.3f} ms  {int8:8.3f} ms  {n * k / int8 / 1e6:14.1f}  "
                  f"{rows * n * k / int8 / 1e6:17.1f}  {int_mm:10.3f} ms")


if __name__ == "__main__":
    main()
