"""A request is counters: `num_computed_tokens` catches up with `num_tokens`.

Prefill and decode are the same thing seen from here: the scheduler gives a request some of
its uncomputed tokens each step; when it has computed all of them, the step samples one
more token, which becomes uncomputed in turn. Only the scheduler changes a request's state.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from oxserve.multimodal.inputs import MultiModalItem, cache_key_ids
from oxserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + output may not exceed this (the model's context)
    eos_token_ids: frozenset[int] = frozenset()  # tokens that end the request unless ignore_eos
    prompt: str | None = None
    priority: int = 0  # scheduling_policy="priority": lower runs first (as vLLM's)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # params.prompt_logprobs: per prompt token scored so far, and its rank (the first token
    # has no tokens before it: None). Complete once the prompt has been computed.
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=lambda: [None])
    prompt_token_ranks: list[int | None] = field(default_factory=lambda: [None])
    # Proposed next tokens (speculative decoding): scheduled after the request's last token
    # and kept only as far as the model's own samples agree with them.
    draft_token_ids: list[int] = field(default_factory=list)
    # Prefix caching: positions a chat template marks as conversation boundaries (before a
    # role token), and the positions ahead where this request's KDA state is to be saved,
    # with why (prefill chunks end there).
    boundaries: tuple[int, ...] = ()
    checkpoint_at: list[tuple[int, str]] = field(default_factory=list)
    # Speculation guard (spec_guard.py): drafts kept and tried, older verifies faded; the
    # prior is a keep rate of 0.75 worth four verifies
    draft_hits: float = 3.0
    draft_trials: float = 4.0
    decodes_without_drafts: int = 0  # since drafting was switched off for it
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # Failure isolation: steps that raised with this request in them, and the position up to
    # which it is recomputed alone after one (a failure there is its own).
    num_failed_steps: int = 0
    isolate_until: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    # Images and videos at their placeholder positions, and the prompt as prefix caching keys
    # it (each item's positions hold a value of its content hash, so images never share cache)
    mm_items: tuple[MultiModalItem, ...] = ()
    prompt_cache_keys: list[int] | None = None
    # Disaggregation: a prefill instance's request hands over its caches when it finishes;
    # a decode instance's arrives with its prompt's caches (`imported_tokens` of them, until
    # it is admitted) and the prefill's sampled token as its first output.
    export_caches: bool = False
    imported_tokens: int = 0

    def __post_init__(self) -> None:
        if self.mm_items and self.prompt_cache_keys is None:
            self.prompt_cache_keys = cache_key_ids(self.prompt_token_ids, self.mm_items)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def prompt_logprob_positions(self, start: int, end: int) -> range:
        """Of positions [start, end), those whose logits score a prompt token not scored yet
        (after preemption, a recompute scores nothing twice)."""
        if self.params.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs) - 1), min(end, len(self.prompt_token_ids) - 1))

    def token_slice(self, start: int, end: int) -> list[int]:
        n_prompt = len(self.prompt_token_ids)
        if start >= n_prompt:  # a decode: never copy the whole history
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - n_prompt)]

    def cache_key_slice(self, start: int, end: int) -> list[int]:
        """`token_slice` as prefix caching sees it: images' positions hold their content keys."""
        if self.prompt_cache_keys is None or start >= len(self.prompt_token_ids):
            return self.token_slice(start, end)
        n_prompt = len(self.prompt_token_ids)
        return self.prompt_cache_keys[start:end] + self.output_token_ids[: max(0, end - n_prompt)]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
