"""oxserve: an inference engine for GLM-5.3-Flash and other hybrid linear-attention MoE models."""

import os
import sys

# torch's libgomp threads spin ~9 ms after each parallel region (GOMP_SPINCOUNT's default
# 300,000 pauses, on a Zen 4), holding a core that a captured step's own threads
# (kernels/native/team.c) need; 20,000 (~0.6 ms there) cost eager prefill nothing measurable.
# libgomp reads it when torch loads it: set only where torch is not imported yet, never over a
# user's setting, and not where the team is off.
if "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ and os.environ.get("OXSERVE_OMP_TEAM") != "0":
    os.environ.setdefault("GOMP_SPINCOUNT", "20000")

from oxserve.llm import LLM  # noqa: E402
from oxserve.outputs import CompletionOutput, RequestOutput  # noqa: E402
from oxserve.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput"]
