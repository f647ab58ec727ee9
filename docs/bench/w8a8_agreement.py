"""How far W8A8 moves the trained default model, teacher-forced on held-out code (docs/quantization.md).

    python docs/bench/w8a8_agreement.py [--windows 16] [--length 192] [--seed 1234]

Windows of stdlib source the model never saw, prefilled in chunks of 64: mean KL and top-1
agreement of bf16 against fp32 (the floor any bf16 variant starts from), and of W8A8 on load
(no smoothing calibration) in fp32 and bf16 against fp32 and bf16.
"""

import argparse

import torch

from oxserve.default_model import default_model
from oxserve.default_model.train import held_out_windows
from oxserve.model.forced import forced_logits
from oxserve.model.loader import load_model
from oxserve.quantization.quality import agreement
from oxserve.quantization.w8a8 import quantize_w8a8_on_load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--length", type=int, default=192)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    path = default_model()
    seqs = held_out_windows(path, args.windows, args.length, args.seed)

    def logits(dtype: torch.dtype, w8a8: bool) -> list[torch.Tensor]:
        model = load_model(path, dtype=dtype, transform=quantize_w8a8_on_load if w8a8 else None).model
        return [forced_logits(model, s, 64) for s in seqs]

    fp32, bf16 = logits(torch.float32, False), logits(torch.bfloat16, False)
    print("bf16 vs fp32:", agreement(fp32, bf16), flush=True)
    print("w8a8 fp32 vs fp32:", agreement(fp32, logits(torch.float32, True)), flush=True)
    w8a8_bf16 = logits(torch.bfloat16, True)
    print("w8a8 bf16 vs fp32:", agreement(fp32, w8a8_bf16))
    print("w8a8 bf16 vs bf16:", agreement(bf16, w8a8_bf16))


if __name__ == "__main__":
    main()
