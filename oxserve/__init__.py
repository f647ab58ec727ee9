"""oxserve: an inference engine for GLM-5.3-Flash and other hybrid linear-attention MoE models."""

from oxserve.llm import LLM
from oxserve.outputs import CompletionOutput, RequestOutput
from oxserve.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput"]
