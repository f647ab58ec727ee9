"""Speculative decoding: propose draft tokens, verify them in one forward pass, keep what
the target model's own sampling agrees with.

    proposer (after each step)   request.draft_token_ids = up to k guesses of what follows:
                                 n-gram lookup in its history, or the MTP layer (greedy, on
                                 the runner, from the step's hidden states: mtp_drafter.py)
    scheduler                    schedules [last token, drafts...] as one decode
    runner                       logits at every one of those positions; `verify` accepts a
                                 prefix of the drafts and adds one token of its own
    rollback                     the scheduler moves num_computed_tokens back over rejected
                                 drafts; KDA rings move their count back (ReplaySSM); MLA
                                 entries of rejected positions are overwritten later

`verify` is rejection sampling (Leviathan et al.; Chen et al.) for a proposer whose draft is
one token with certainty (n-gram lookup, greedy MTP): draft t at a position with target distribution p
is kept with probability p(t); a rejection samples from p with t removed, renormalised.
The tokens that come out are distributed exactly as sampling the target token by token, for
any temperature, top-k/top-p/min-p and penalties (each position's penalties count the
drafts before it as output); greedy keeps a draft iff it is the argmax, so greedy output is
the plain greedy output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from oxserve.engine.request import Request
from oxserve.engine.sampler import SamplingRow, apply_penalties, filtered_weights, is_plain_greedy, logprob_entries

METHODS = ("ngram", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; choose one of {', '.join(METHODS)}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
                             f"{self.prompt_lookup_max}")

    @classmethod
    def parse(cls, text: str | None) -> SpeculativeConfig | None:
        """From vLLM's JSON form, e.g. '{"method": "ngram", "num_speculative_tokens": 4}'."""
        if not text:
            return None
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not JSON: {e}") from None
        if not isinstance(fields, dict) or "method" not in fields or "num_speculative_tokens" not in fields:
            raise ValueError('speculative_config needs at least {"method": ..., "num_speculative_tokens": k}')
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        return cls(**fields)


class NgramProposer:
    """vLLM's `ngram` method: drafts from the request's own history."""

    def __init__(self, config: SpeculativeConfig):
        self.lookup_max, self.lookup_min = config.prompt_lookup_max, config.prompt_lookup_min
        self.deferred_s = 0.0  # (nothing is deferred to a proposal: `MTPProposer.deferred_s`)

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        return {r.request_id: ngram_drafts(r.prompt_token_ids + r.output_token_ids, k, self.lookup_max, self.lookup_min)
                for r, k in wanted}  # fmt: skip


class MTPProposer:
    """vLLM's `mtp` method: the checkpoint's MTP layer drafts, on the runner (`MTPDrafter`),
    from the hidden states of the step that just ran."""

    def __init__(self, runner):
        self.runner = runner
        self.deferred_s = 0.0  # of the last `propose`: MTP passes plain steps left owed, not a cost of the drafts

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        drafts = self.runner.propose_drafts({r.request_id: k for r, k in wanted})
        self.deferred_s = self.runner.drafter.catch_up_s
        return drafts


def make_proposer(config: SpeculativeConfig, runner) -> NgramProposer | MTPProposer:
    return MTPProposer(runner) if config.method == "mtp" else NgramProposer(config)


def ngram_drafts(tokens: list[int], k: int, lookup_max: int, lookup_min: int) -> list[int]:
    """Prompt lookup: the k tokens that followed the latest earlier occurrence of the
    longest suffix (lookup_max down to lookup_min tokens) of `tokens`."""
    for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def lookup_replay(prompt: list[int], output: list[int], config: SpeculativeConfig) -> tuple[int, int, int]:
    """What n-gram speculation at full depth would do on an output known in advance (a greedy
    output is the same with or without it): (decode steps, draft tokens, accepted tokens). The
    first output token comes from the prefill; each decode step then drafts up to k tokens
    (fewer before the output's end), keeps the prefix that matches, and yields one token more.
    An upper bound on the engine's gain: its guard (spec_guard.py) drafts less, or not at all,
    where drafts have not been paying."""
    k = config.num_speculative_tokens
    steps = drafted = accepted = 0
    i = 1
    while i < len(output):
        drafts = ngram_drafts(prompt + output[:i], min(k, len(output) - i - 1), config.prompt_lookup_max,
                              config.prompt_lookup_min)
        kept = next((j for j, t in enumerate(drafts) if t != output[i + j]), len(drafts))
        steps += 1
        drafted += len(drafts)
        accepted += kept
        i += kept + 1
    return steps, drafted, accepted


def acceptance(num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int) -> dict:
    """vLLM's figures: acceptance rate = accepted / draft tokens; mean acceptance length =
    tokens per verifying step = 1 + accepted / drafts (1 with no drafts)."""
    return {
        "num_drafts": num_drafts, "num_draft_tokens": num_draft_tokens, "num_accepted_tokens": num_accepted_tokens,
        "acceptance_rate": num_accepted_tokens / num_draft_tokens if num_draft_tokens else 0.0,
        "mean_acceptance_length": 1 + num_accepted_tokens / num_drafts if num_drafts else 1.0,
    }


@dataclass
class Verified:
    token_ids: list[int]  # the accepted drafts, then the token the target sampled itself
    logprobs: list[dict[int, float]] | None


def verify(logits: torch.Tensor, drafts: list[int], row: SamplingRow, argmax: list[int] | None = None) -> Verified:
    """logits [len(drafts) + 1, V]: the target's logits after the request's last token and
    after each draft; `argmax`: each of those rows' argmax where the step made them (a
    replayed step does), which is all plain greedy needs. Returns the tokens this step yields
    (1 to len(drafts) + 1)."""
    n = len(drafts) + 1
    if argmax is not None and is_plain_greedy(row.params):
        kept = next((i for i, token in enumerate(drafts) if token != argmax[i]), len(drafts))
        return Verified(argmax[: kept + 1], None)
    rows = [SamplingRow(row.params, row.prompt_token_ids, row.output_token_ids + drafts[:i], row.generator) for i in range(n)]
    x = apply_penalties(logits.to(torch.float32, copy=True), rows)
    greedy = row.params.greedy
    weights, totals = (None, None) if greedy else filtered_weights(x, [row.params] * n)
    tokens: list[int] = []
    for i in range(n):
        if greedy:
            choice = int(x[i].argmax())
        elif i < len(drafts) and _uniform(row.generator, logits.device) < float(weights[i, drafts[i]]) / float(totals[i]):
            choice = drafts[i]
        else:
            residual = weights[i].clone()
            if i < len(drafts):
                residual[drafts[i]] = 0.0  # max(p - q, 0) for a draft q that is one token for sure
            choice = _draw(residual, row.generator)
        tokens.append(choice)
        if i == len(drafts) or choice != drafts[i]:
            break
    logprobs = None
    if row.params.logprobs is not None:
        raw = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
        logprobs = logprob_entries(raw, tokens, [row.params.logprobs] * len(tokens))
    return Verified(tokens, logprobs)


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    """One U(0, 1) draw from the request's generator (on its device), else the default RNG."""
    return float(torch.rand(1, dtype=torch.float64, generator=generator, device=generator.device if generator else device))


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token drawn from `probs` (weights: they need not sum to 1)."""
    cdf = probs.double().cumsum(0)
    u = _uniform(generator, probs.device) * float(cdf[-1])
    at = torch.tensor([u], dtype=torch.float64, device=cdf.device)
    picked = int(torch.searchsorted(cdf, at, right=True).clamp(max=probs.numel() - 1))
    return picked if probs[picked] > 0 else int(probs.argmax())
