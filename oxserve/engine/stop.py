"""When a request stops: EOS, stop token ids, stop strings, max_tokens."""

from __future__ import annotations

from oxserve.engine.request import Request
from oxserve.sampling_params import SamplingParams


class StopChecker:
    def __init__(self, params: SamplingParams, eos_token_ids: set[int]):
        self.params = params
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        self.stop_ids = set(params.stop_token_ids)
        self._cut: int | None = None  # text length to show once a stop string matched

    def check(self, request: Request, token: int, text: str, delta: str) -> tuple[str, int | str | None] | None:
        """(finish_reason, stop_reason) if the request must stop after `token`, else None."""
        if token in self.eos:
            return "stop", None
        if token in self.stop_ids:
            return "stop", token
        if self.params.stop and delta:
            if hit := self._find_stop(text, len(delta)):
                return "stop", hit
        max_tokens = self.params.max_tokens
        if max_tokens is not None and len(request.output_token_ids) >= max_tokens:
            return "length", None
        return None

    def _find_stop(self, text: str, delta_len: int) -> str | None:
        # A stop string can only newly appear in the delta plus the len(stop)-1 chars before it.
        for stop in self.params.stop:
            start = max(0, len(text) - delta_len - len(stop) + 1)
            at = text.find(stop, start)
            if at >= 0:
                self._cut = at + len(stop) if self.params.include_stop_str_in_output else at
                return stop
        return None

    def visible_text(self, text: str) -> str:
        return text if self._cut is None else text[: self._cut]
