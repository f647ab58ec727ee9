"""bf16 fidelity of this checkout against HF transformers in fp32, on fixed held-out text: run
it in two checkouts to compare them on the same sequences (what the experiment quality gate
cannot do when a change moves the arithmetic).

    python docs/bench/fidelity_ab.py                      # in each checkout (PYTHONPATH=.)

16 held-out windows of 400 tokens of the default model (seed 20261204), prefilled in chunks
of 256 and the last 32 decoded one by one, as `tests/test_fidelity_bf16.py` runs them.
Cited by docs/performance.md ("Prefill on native kernels").
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import Glm5NextForConditionalGeneration

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from oxserve.default_model import default_model  # noqa: E402
from oxserve.default_model.train import held_out_windows  # noqa: E402
from oxserve_forward import ForcedRun  # noqa: E402
from test_fidelity_bf16 import per_position  # noqa: E402


def main() -> None:
    path = default_model()
    sequences = held_out_windows(path, 16, 400, 20261204)
    ids = torch.tensor(sequences)
    with torch.no_grad():
        hf32 = Glm5NextForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()(input_ids=ids).logits
        hf16 = Glm5NextForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16).eval()(input_ids=ids).logits
    run = ForcedRun(path, torch.bfloat16)
    ours = torch.stack([run.logits(s, 256, decode_from=len(s) - 32) for s in sequences])
    for name, logits in (("oxserve bf16", ours), ("HF bf16", hf16)):
        kl, top1 = per_position(hf32, logits)
        print(f"{name}: mean KL vs HF fp32 {kl.mean():.4e}, max {kl.max():.4e}, top-1 differs {top1.mean():.3%}")


if __name__ == "__main__":
    main()
