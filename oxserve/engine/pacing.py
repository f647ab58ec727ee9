"""Stall-free batching: how many prefill tokens may ride along with a step's decodes.

A step that carries a long prefill chunk next to running decodes makes every one of those
decodes wait for it; their inter-token latency spikes (Sarathi-Serve's "generation stalls").
The pacer keeps a mixed step to at most `max_stall` times the cost of a decode-only step:

    prefill budget = (max_stall - 1) * decode step / prefill token

Both costs are measured from the engine's own step times, as exponentially weighted means:

- a prefill token's cost, from steps with at least `BIG_PREFILL` prefill tokens (the fixed
  cost of a prefill is small against them; from small chunks it would look dear per token,
  shrink the next budget and feed back into starvation), less the decode part;
- the decode part, from every step with decodes, less its prefill tokens at that cost. Under
  steady arrivals every step may carry some prefill, so decode-only steps alone could not
  follow a growing batch.

The bound is for a machine with headroom. When prompts queue up faster than it lets them
through (a backlog of prefill tokens, waiting or part-computed), holding them back no longer
smooths anything: it keeps fewer requests decoding and costs throughput, and with most steps
carrying prefill the stall becomes the typical step rather than the tail. So a step may also
take 1 / `CLEAR_STEPS` of the backlog: at low load the stall bound decides, under saturation
the backlog does (a backlog B then drains at a share of itself a step, then at the bound).

The budget is rounded down to whole `MIN_CHUNK`s and never falls below one, so a prompt
always advances. Until both costs are known, and in steps without watched decodes (the
scheduler counts those whose output is wanted as it comes: not `FINAL_ONLY` requests), only
`max_num_batched_tokens` bounds the prefill.
"""

from __future__ import annotations

MIN_CHUNK = 16
BIG_PREFILL = 256
SMOOTHING = 0.25  # weight of the newest measurement
CLEAR_STEPS = 16  # a step may take 1/CLEAR_STEPS of the prefill backlog, whatever the stall bound


class StepPacer:
    def __init__(self, max_stall: float):
        self.max_stall = max_stall
        self.decode_step_s: float | None = None  # the decode part of a step, at the current batch
        self.prefill_token_s: float | None = None

    def observe(self, prefill_tokens: int, decodes: int, seconds: float) -> None:
        """One finished step: its prefill tokens, its decode requests, its wall time."""
        if self.max_stall <= 0:
            return
        if prefill_tokens >= BIG_PREFILL:
            decode_part = self.decode_step_s if decodes and self.decode_step_s is not None else 0.0
            self.prefill_token_s = _mix(self.prefill_token_s, max(seconds - decode_part, 0.0) / prefill_tokens)
        if decodes and (not prefill_tokens or self.prefill_token_s is not None):
            prefill_part = prefill_tokens * (self.prefill_token_s or 0.0)
            self.decode_step_s = _mix(self.decode_step_s, max(seconds - prefill_part, 0.0))

    def prefill_budget(self, decodes: int, backlog: int = 0) -> int | None:
        """Most prefill tokens for a step beside `decodes` watched decode requests while
        `backlog` prompt tokens wait to be computed (None: no bound)."""
        if not decodes or self.decode_step_s is None or not self.prefill_token_s:
            return None
        tokens = max((self.max_stall - 1) * self.decode_step_s / self.prefill_token_s, backlog / CLEAR_STEPS)
        return max(MIN_CHUNK, int(tokens) // MIN_CHUNK * MIN_CHUNK)


def _mix(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
