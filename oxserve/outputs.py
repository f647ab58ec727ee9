"""What the engine hands back to callers (vLLM-shaped)."""

from __future__ import annotations

from typing import Any
from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # One dict per generated token: token id -> logprob; always holds the sampled token.
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (failed in the engine) | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, {token_id: logprob} holding
    # the prompt token (first) plus the top-k, None for the first token (it has no prefix);
    # and the prompt token's rank in its distribution (1: the most likely). On every output
    # once the prompt has been computed (so not on an abort before that).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ranks: list[int | None] | None = None
    # Disaggregated prefill: a request added with export_caches=True finishes holding its
    # caches (a `oxserve.disagg.snapshot.CacheSnapshot`) for a decode instance.
    kv_snapshot: Any = None
