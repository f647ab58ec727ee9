"""A request's text as outputs carry it: decoded from its tokens, cut at a stop string, and
sent in deltas that never take back what they sent.

`OutputText` is the engine's, one a request; `TextDeltas` turns a request's cumulative
outputs into deltas, for the engine's DELTA outputs and the server's streams alike.
"""

from __future__ import annotations

from oxserve.engine.stop import StopStrings
from oxserve.sampling_params import SamplingParams
from oxserve.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputText:
    """A request's decoded text so far and its stop strings. Without stop strings to look for,
    tokens are decoded when the text is read, not as they come: a request that wants no
    output until it finishes (FINAL_ONLY) decodes its tokens once, at the end."""

    def __init__(self, tokenizer: Tokenizer | None, params: SamplingParams):
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stops = StopStrings(params)
        self._undecoded: list[int] = []  # tokens taken, not decoded yet (no stop strings)

    def push(self, token: int) -> str | None:
        """Take the next accepted token; the stop string it completed, if any."""
        if self.detok is None:
            return None
        if not self.stops.params.stop:
            self._undecoded.append(token)
            return None
        delta = self.detok.push(token)
        return self.stops.check(self.detok.text, len(delta))

    @property
    def visible(self) -> str:
        if self.detok is None:
            return ""
        for token in self._undecoded:
            self.detok.push(token)
        self._undecoded.clear()
        return self.stops.visible_text(self.detok.text)


class TextDeltas:
    """What one choice has sent so far, and the next delta of the engine's growing text.

    A stop string is cut from the text once it is complete; until then its possible start
    at the end of the text is held back, so no text is ever sent and then retracted.
    """

    def __init__(self, params: SamplingParams):
        longest = max((len(s) for s in params.stop), default=0)
        self.holdback = 0 if params.include_stop_str_in_output else max(longest - 1, 0)
        self.text_sent = 0
        self.tokens_sent = 0
        self.deltas_sent = 0

    def next(self, text: str, token_ids: list[int], logprobs: list[dict[int, float]] | None,
             finished: bool) -> tuple[str, list[int], list[dict[int, float]] | None]:
        """The delta of a choice's cumulative text, tokens and logprobs (copies)."""
        end = len(text) if finished else len(text) - self.holdback
        end = max(end, self.text_sent)
        new_text = text[self.text_sent : end]
        start = self.tokens_sent
        self.text_sent, self.tokens_sent = end, len(token_ids)
        self.deltas_sent += 1
        return new_text, token_ids[start:], logprobs[start:] if logprobs is not None else None
