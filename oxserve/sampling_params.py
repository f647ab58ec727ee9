"""Per-request sampling settings (vLLM conventions), validated on construction."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

from oxserve.structured.params import StructuredOutputs

# Lower temperatures decode greedily (vLLM's _SAMPLING_EPS): their softmax is one-hot in
# all but name, and dividing logits by them can overflow to inf and the softmax to NaN.
MIN_SAMPLING_TEMPERATURE = 1e-5


class RequestOutputKind(enum.IntEnum):
    """What `LLMEngine.step` returns for a request still running (vLLM's names): everything
    so far, only what is new since its last output, or nothing until it finishes (what
    `LLM.generate` asks for: an output built every step is ~3 us a request on cold caches)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token plus top-k
    # None: off; k >= 0: per prompt token, its logprob given the tokens before it, plus the top-k
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None  # a grammar the output must match
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        kinds = {kind.value for kind in RequestOutputKind}
        _check(isinstance(self.output_kind, int) and not isinstance(self.output_kind, bool) and self.output_kind in kinds,
               f"output_kind must be one of {sorted(kinds)} (RequestOutputKind), got {self.output_kind!r}")
        self.output_kind = RequestOutputKind(self.output_kind)
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(
            self.seed is None or (isinstance(self.seed, int) and -(2**63) <= self.seed < 2**63),
            f"seed must be a 64-bit signed integer, got {self.seed!r}",
        )
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        # Finite: an infinite temperature or penalty turns logits into NaN inside a step.
        _check(math.isfinite(self.temperature) and self.temperature >= 0.0, f"temperature must be finite and >= 0, got {self.temperature}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0,
               f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}")  # fmt: skip
        _check(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            f"logprobs must be an integer in [0, 20], got {self.logprobs!r}",
        )
        _check(
            self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
            f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be non-negative integers",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    def fan_out(self) -> list["SamplingParams"]:
        """The n single-sample requests that `n` stands for; sample j draws with seed + j
        (wrapped to 64 bits), so each one is reproducible on its own."""
        return [
            replace(self, n=1, seed=None if self.seed is None else (self.seed + j + 2**63) % 2**64 - 2**63)
            for j in range(self.n)
        ]


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
