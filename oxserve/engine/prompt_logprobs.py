"""Prompt logprobs: each prompt token's logprob given the tokens before it, plus the top-k.

They come out of the prefill itself: the runner has the model keep the final hidden state
of every scored position next to the sampling rows (`ScheduledRequest.prompt_logprob_positions`),
and `score_prompt_tokens` turns those rows into logprob dicts a slice at a time, so that a
long prompt's [tokens, vocab] logits never exist at once; only the dicts outlive a step.
Values are from the raw model distribution (log_softmax in float32), as the sampler's are.
"""

from __future__ import annotations

import torch

from oxserve.engine.interface import PromptLogprobs, ScheduledRequest
from oxserve.engine.sampler import logprob_entries
from oxserve.model.glm5_next import Glm5NextForCausalLM

# Logit elements alive at once while scoring (64 MiB of float32): 128 rows of a 131k vocabulary.
MAX_LOGIT_ELEMENTS = 1 << 24


def score_prompt_tokens(
    model: Glm5NextForCausalLM,
    hidden: torch.Tensor,
    scheduled: list[ScheduledRequest],
    prompts: list[list[int]],
    top: list[int | None],
) -> dict[str, PromptLogprobs]:
    """`hidden` [P, D]: the final hidden states of every request's `prompt_logprob_positions`,
    in request order; `prompts[i]` and `top[i]`: request i's prompt and its top-k."""
    targets: list[int] = []  # the prompt token each row scores: the one after its position
    row_top: list[int | None] = []
    for s, prompt, k in zip(scheduled, prompts, top):
        targets += prompt[s.prompt_logprob_positions.start + 1 : s.prompt_logprob_positions.stop + 1]
        row_top += [k] * len(s.prompt_logprob_positions)
    entries: list[dict[int, float]] = []
    ranks: list[int] = []
    rows = max(1, MAX_LOGIT_ELEMENTS // model.config.vocab_size)
    for start in range(0, len(targets), rows):
        logits = model.compute_logits(hidden[start : start + rows])
        if logits is None:  # a tensor-parallel rank but the first: it only lends its piece of the head
            continue
        logprobs = torch.log_softmax(logits, dim=-1)
        chunk_targets = targets[start : start + rows]
        entries += logprob_entries(logprobs, chunk_targets, row_top[start : start + rows])
        chosen = logprobs.gather(1, torch.tensor(chunk_targets, device=logprobs.device).unsqueeze(1))
        ranks += (logprobs >= chosen).sum(dim=-1).tolist()  # vLLM's rank: tokens at least as likely
    result: dict[str, PromptLogprobs] = {}
    row = 0
    for s in scheduled:
        n = len(s.prompt_logprob_positions)
        if n:
            first = s.prompt_logprob_positions.start + 1
            result[s.request_id] = PromptLogprobs(first, entries[row : row + n], ranks[row : row + n])
            row += n
    return result
