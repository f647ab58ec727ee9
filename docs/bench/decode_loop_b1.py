"""One greedy request decoded for 4,000 steps on the default model (bf16, 2 threads), for
`perf record` (docs/quantization.md, "AVX2 panels"); prints the mean step time. The first
15 s are start-up and warm-up, hence perf's -D:

    perf record -D 15000 -F 2000 python docs/bench/decode_loop_b1.py [w8a8]
    perf report --no-children --sort dso,sym
"""

import sys
import time

import torch

from oxserve.config import EngineConfig, ModelConfig
from oxserve.default_model import default_model
from oxserve.engine.engine import LLMEngine
from oxserve.sampling_params import SamplingParams

torch.set_num_threads(2)
quantization = sys.argv[1] if len(sys.argv) > 1 else "none"
engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(default_model()), dtype="bfloat16", quantization=quantization)))
prompt = list(range(100, 300))
engine.add_request("warm-up", prompt, SamplingParams(max_tokens=50, ignore_eos=True, temperature=0.0))
while engine.has_unfinished_requests():
    engine.step()
engine.add_request("timed", prompt, SamplingParams(max_tokens=4000, ignore_eos=True, temperature=0.0))
start, steps = time.perf_counter(), 0
while engine.has_unfinished_requests():
    engine.step()
    steps += 1
print(f"quantization {quantization}: {(time.perf_counter() - start) / steps * 1e3:.2f} ms a step")
