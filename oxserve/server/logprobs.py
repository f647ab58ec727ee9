"""Engine logprobs (one `{token_id: logprob}` per token, sampled token first) in OpenAI's shapes.

    completions: {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{tok: lp}], "text_offset": [...]}
    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
    vLLM's prompt_logprobs: [null, {"<token id>": {"logprob", "rank", "decoded_token"}}, ...]

With echo, a completion's logprobs start with the prompt's tokens; the first prompt token has
no logprob (nothing comes before it): null in `token_logprobs` and in `top_logprobs`.
"""

from __future__ import annotations

import math
from typing import Any

from oxserve.tokenizer import Tokenizer

FLOOR = -9999.0  # JSON has no -inf; vLLM reports impossible tokens with this value


class LogprobFormatter:
    def __init__(self, tokenizer: Tokenizer | None, as_token_ids: bool):
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids or tokenizer is None

    def token(self, token_id: int) -> str:
        if self.as_token_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)  # type: ignore[union-attr]

    def completion(self, token_ids: list[int], logprobs: list[dict[int, float] | None], offset: int) -> dict[str, Any]:
        """`offset`: characters of text before these tokens (for text_offset). An entry is
        None for the first token of an echoed prompt."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, logprobs):
            text = self.token(tid)
            tokens.append(text)
            token_logprobs.append(None if entry is None else _finite(entry[tid]))
            # The sampled token plus the top-k: up to k + 1 entries, as OpenAI documents.
            tops.append(None if entry is None else {self.token(t): _finite(lp) for t, lp in entry.items()})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def prompt_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float] | None], ranks: list[int | None]
    ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's prompt_logprobs. Ranks: the prompt token's comes from the engine; a top-k
        token's is one more than the entries above it (the top-k hold every token above them)."""
        result: list[dict[str, dict[str, Any]] | None] = []
        for tid, entry, rank in zip(token_ids, logprobs, ranks):
            if entry is None:
                result.append(None)
                continue
            result.append({
                str(t): {"logprob": _finite(lp), "rank": rank if t == tid else 1 + sum(v > lp for v in entry.values()),
                         "decoded_token": self.token(t)}
                for t, lp in entry.items()
            })  # fmt: skip
        return result

    def chat(self, token_ids: list[int], logprobs: list[dict[int, float]], top_k: int) -> dict[str, Any]:
        content = []
        for tid, entry in zip(token_ids, logprobs):
            top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_k]
            content.append({**self._chat_entry(tid, entry[tid]), "top_logprobs": [self._chat_entry(t, lp) for t, lp in top]})
        return {"content": content}

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def joined(first: dict[str, list], second: dict[str, list]) -> dict[str, list]:
    """Two completions logprobs objects as one, `first`'s tokens first."""
    return {key: first[key] + second[key] for key in first}


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR
