"""Minor page faults and system time of one LLM.generate, with and without kept memory.

    python docs/bench/page_faults.py off   # glibc's default thresholds
    python docs/bench/page_faults.py on    # the engine's (oxserve/engine/memory.py)

8 prompts x 256 random tokens, 48 greedy output tokens, default model, fp32, one thread;
counted with getrusage around the generate, after a warm-up generate.
"""

import random
import resource
import sys
import time

import oxserve.engine.engine as engine_module
from oxserve import LLM, SamplingParams

if sys.argv[1:] == ["off"]:
    engine_module.keep_freed_memory = lambda: False
llm = LLM(None, dtype="float32", threads=1)
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(100, 8000) for _ in range(256)]} for _ in range(8)]
llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))
before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
llm.generate(prompts, SamplingParams(max_tokens=48, ignore_eos=True, temperature=0))
after = resource.getrusage(resource.RUSAGE_SELF)
print(f"{sys.argv[1]}: wall {time.perf_counter() - start:.2f} s, minor faults {after.ru_minflt - before.ru_minflt}, "
      f"system {after.ru_stime - before.ru_stime:.2f} s, user {after.ru_utime - before.ru_utime:.2f} s")
