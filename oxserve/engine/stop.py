"""When a request stops.

Token stops (EOS, stop token ids, max_tokens, the context limit) need only token ids: the
scheduler checks them as it appends each accepted token. Stop strings need text: the
engine's output side checks them on the detokenized text and finishes the request early.
"""

from __future__ import annotations

from oxserve.engine.request import Request
from oxserve.sampling_params import SamplingParams

Stop = tuple[str, int | str | None]  # (finish_reason, stop_reason)


def token_stop(request: Request, token: int) -> Stop | None:
    """Whether `request` must stop after `token`, already appended to its output."""
    params = request.params
    if token in request.eos_token_ids and not params.ignore_eos:
        return "stop", None
    if token in params.stop_token_ids:
        return "stop", token
    if params.max_tokens is not None and len(request.output_token_ids) >= params.max_tokens:
        return "length", None
    if request.num_tokens >= request.max_total_tokens:
        return "length", None
    return None


class StopStrings:
    """Finds the first stop string in a request's growing text and where to cut it."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self._cut: int | None = None  # text length to show once a stop string matched

    def check(self, text: str, delta_len: int) -> str | None:
        """The stop string that the last `delta_len` characters of `text` completed, if any."""
        if not self.params.stop or not delta_len or self._cut is not None:
            return None
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
