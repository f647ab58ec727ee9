"""The plain data a step passes from the scheduler to the runner and back.

Nothing here holds a live object: ids, token ids, block ids, counts (and the pixels of a
request's images, as tensors), so a
`SchedulerOutput` can be pickled to worker processes (tensor parallelism, disaggregated
prefill/decode) and a `ModelRunnerOutput` sent back.

    Scheduler --SchedulerOutput--> ModelRunner(s) --ModelRunnerOutput--> Scheduler.update_from_output

The runner keeps what it needs of a request between steps (its block table, the tokens it
has fed, its sampling state) from `new_requests` and the per-step `ScheduledRequest`s, and
drops it when the request's id comes back in `finished_request_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import cached_property

import torch

from oxserve.cache.manager import CacheOps
from oxserve.multimodal.inputs import MultiModalItem
from oxserve.sampling_params import SamplingParams

_NO_PIXELS = torch.empty(0)

# What a step's time says of the steps of its shape to come (`CapturedDecode.novelty`, which
# the runner reports and the speculation guard reads):
STEADY = ""  # replayed (or eager for good: refused capture): as they will cost
NEW_SHAPE = "new"  # its shape met first, so eager: what every step costs where shapes never recur
SETTLING = "settling"  # recording, or the first replay (which builds its plan): once per shape


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner starts from scratch this step: first scheduled, or resumed after
    preemption. Its block table restarts from its `ScheduledRequest.new_block_ids`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Output tokens already in the cache: a preempted request resuming from a prefix
    # checkpoint past its prompt (their penalties count them).
    output_token_ids: list[int] = field(default_factory=list)
    mm_items: tuple[MultiModalItem, ...] = ()  # images and videos at their prompt positions


@dataclass(slots=True)
class ScheduledRequest:
    """What one request computes this step. Not changed once made (not frozen: a frozen
    dataclass sets each field through object.__setattr__, ~1.0 against 0.21 us to make one,
    and a step makes one a request)."""

    request_id: str
    num_computed_tokens: int  # tokens already in the cache: the position of the first new token
    token_ids: list[int]  # the tokens computed this step, drafts (if any) last
    new_block_ids: list[int]  # blocks appended to the request's block table this step
    state_slot: int  # the request's KDA state slot
    samples: bool  # this step reaches the request's last token, so it yields new token(s)
    num_draft_tokens: int = 0  # speculative tokens at the end of token_ids, to be verified
    # Prompt logprobs: the positions (within the request, all in this step's tokens) whose
    # logits score the prompt token after them; empty when none are wanted or all are known.
    prompt_logprob_positions: range = range(0)
    # Derived once (a step reads each about ten times a request):
    num_new_tokens: int = field(init=False)
    verifies: bool = field(init=False)  # a decode with drafts: the runner verifies them (logits at every token)
    is_decode: bool = field(init=False)  # one new token on top of a cached context (drafts ride along with it)

    def __post_init__(self) -> None:
        n = self.num_new_tokens = len(self.token_ids)
        self.verifies = self.num_computed_tokens > 0 and self.num_draft_tokens > 0
        self.is_decode = self.num_computed_tokens > 0 and n - self.num_draft_tokens == 1

    def __reduce__(self):
        return _rebuilt(self)


@dataclass(frozen=True)
class SchedulerOutput:
    new_requests: list[NewRequestData]
    scheduled: list[ScheduledRequest]  # decodes first, then prefill chunks
    finished_request_ids: list[str] = field(default_factory=list)  # since the last step: drop their state
    cache_ops: CacheOps = field(default_factory=CacheOps)  # prefix caching: applied before the forward
    # Preempted (or isolated after a failed step) since the last step: back in the queue, their
    # blocks freed; they restart on the runner as new requests
    requeued_request_ids: list[str] = field(default_factory=list)

    def __reduce__(self):
        return _rebuilt(self)

    # Counted once (the step never changes): the engine, scheduler and runner each read them.
    @cached_property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def without_pixels(self) -> SchedulerOutput:
        """The step for parallel ranks but the first: their images' positions without the
        patches (rank 0 alone encodes, see `oxserve.multimodal.embedder`)."""
        if not any(new.mm_items for new in self.new_requests):
            return self
        bare = [replace(new, mm_items=tuple(replace(item, patches=_NO_PIXELS) for item in new.mm_items))
                for new in self.new_requests]  # fmt: skip
        return replace(self, new_requests=bare)

    @cached_property
    def num_decode_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.is_decode)

    @cached_property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)


def _rebuilt(step) -> tuple:
    """Pickled as the fields a step is made of: what is derived from them (counts) is derived
    again on the other side rather than sent (a decode step's message to parallel ranks)."""
    return type(step), tuple(getattr(step, f.name) for f in fields(step) if f.init)


@dataclass(frozen=True)
class PromptLogprobs:
    """Consecutive prompt tokens scored this step, from prompt index `first_token` on."""

    first_token: int
    logprobs: list[dict[int, float]]  # per token: {token: logprob}, the prompt token first, then the top-k
    ranks: list[int]  # the prompt token's rank in its distribution (1: the most likely)


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Per sampling request: the tokens it accepted this step (one without speculation; the
    verified drafts plus one more with it) and, if asked for, their logprobs. Per request
    with `prompt_logprob_positions`, sampling or not: the prompt tokens those scored."""

    request_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[dict[int, float]] | None]
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
