"""What a soak sends and how each answer is judged.

A pool of greedy completion requests (token-id prompts, `logprobs: 2`, the answer's token ids
in the logprobs), each answered once alone before the soak: its reference. During the soak
each request is sent as a plain request, a stream, a stream the client leaves after a few
chunks, a request the client gives up on, or a line of a batch job. Every request ends in
exactly one outcome (`Outcome`); an answer is corrupted if it parts from its reference where
the reference's top two tokens were not a near tie (batching may flip those, by rounding).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import httpx

KINDS = ("plain", "stream", "leave", "give_up")  # batch lines are sent by the batch jobs
# Outcomes. Failures of the server: "corrupted", "lost" (no answer, no error: hung or cut
# short while the server was up), "bad_error" (an error without OpenAI's error body),
# "server_error" (a 500, or a stream's error event, while no restart explains it). "error"
# is a clear refusal (429, 503 while draining); "cut" a request a restart cut off.
OK, CORRUPTED, ERROR, SERVER_ERROR, CUT, LEFT, LOST, BAD_ERROR = (
    "ok", "corrupted", "error", "server_error", "cut", "left", "lost", "bad_error")
ABORTED = "aborted"  # the server aborted it (a drain past its timeout): a failure unless a restart explains it
FAILURES = (CORRUPTED, LOST, BAD_ERROR, SERVER_ERROR)


@dataclass(frozen=True)
class PoolRequest:
    prompt: list[int]
    max_tokens: int

    def body(self, model: str, stream: bool = False) -> dict:
        return {"model": model, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0.0, "ignore_eos": True,
                "logprobs": 2, "return_tokens_as_token_ids": True, "stream": stream}  # fmt: skip


@dataclass
class Reference:
    tokens: list[str]
    margins: list[float]  # top-1 minus top-2 logprob at each position


@dataclass
class Outcome:
    kind: str
    result: str
    latency_s: float | None = None  # plain and batch: to the answer; streams: to the first token
    detail: str = ""


def make_pool(rng: random.Random, size: int, vocab: int, max_prompt: int, max_tokens: int) -> list[PoolRequest]:
    return [PoolRequest([rng.randrange(1, vocab) for _ in range(rng.randrange(4, max_prompt + 1))], rng.randrange(4, max_tokens + 1))
            for _ in range(size)]  # fmt: skip


def reference_of(choice: dict) -> Reference:
    lp = choice["logprobs"]
    margins = []
    for top in lp["top_logprobs"]:
        values = sorted(top.values(), reverse=True)
        margins.append(values[0] - values[1] if len(values) > 1 else float("inf"))
    return Reference(list(lp["tokens"]), margins)


def judge(tokens: list[str], ref: Reference, tie_margin: float) -> tuple[str, str]:
    """(OK or CORRUPTED, why) for an answer's tokens against the reference."""
    if len(tokens) != len(ref.tokens):  # ignore_eos and a fixed max_tokens: the length never varies
        return CORRUPTED, f"{len(tokens)} tokens instead of {len(ref.tokens)}"
    for i, (got, want) in enumerate(zip(tokens, ref.tokens)):
        if got != want:
            if ref.margins[i] < tie_margin:
                return OK, ""  # a near tie: either pick is right, and the rest follows from it
            return CORRUPTED, f"token {i}: {got} instead of {want} (reference margin {ref.margins[i]:.3g})"
    return OK, ""


def error_outcome(kind: str, response: httpx.Response, start: float) -> Outcome:
    try:
        error = response.json()["error"]
        clear = isinstance(error["message"], str) and bool(error["message"])
    except (ValueError, KeyError, TypeError):
        clear = False
    result = BAD_ERROR if not clear else SERVER_ERROR if response.status_code == 500 else ERROR
    return Outcome(kind, result, time.monotonic() - start, f"HTTP {response.status_code}")


async def plain(client: httpx.AsyncClient, url: str, model: str, req: PoolRequest, ref: Reference, tie: float,
                give_up_after: float | None = None) -> Outcome:  # fmt: skip
    kind = "plain" if give_up_after is None else "give_up"
    start = time.monotonic()
    try:
        r = await client.post(f"{url}/v1/completions", json=req.body(model), timeout=give_up_after or 600)
    except httpx.TimeoutException:
        return Outcome(kind, LEFT if give_up_after is not None else LOST, time.monotonic() - start, "timed out")
    if r.status_code != 200:
        return error_outcome(kind, r, start)
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "abort":  # a drain past its timeout aborts what runs
        return Outcome(kind, ABORTED, time.monotonic() - start)
    result, why = judge(choice["logprobs"]["tokens"], ref, tie)
    return Outcome(kind, result, time.monotonic() - start, why)


async def stream(client: httpx.AsyncClient, url: str, model: str, req: PoolRequest, ref: Reference, tie: float,
                 leave_after: int | None = None) -> Outcome:  # fmt: skip
    kind = "stream" if leave_after is None else "leave"
    start, first, tokens, done, aborted = time.monotonic(), None, [], False, False
    async with client.stream("POST", f"{url}/v1/completions", json=req.body(model, stream=True), timeout=600) as r:
        if r.status_code != 200:
            await r.aread()
            return error_outcome(kind, r, start)
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
                break
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Outcome(kind, SERVER_ERROR, None, f"error event: {chunk['error'].get('message', '')[:80]}")
            for c in chunk.get("choices", []):
                aborted = aborted or c.get("finish_reason") == "abort"
                if c.get("logprobs") and c["logprobs"]["tokens"]:
                    first = first or time.monotonic()
                    tokens += c["logprobs"]["tokens"]
            if leave_after is not None and len(tokens) >= leave_after:
                return Outcome(kind, LEFT, None if first is None else first - start)
    if not done:
        return Outcome(kind, LOST, None, "the stream ended without [DONE] or an error event")
    if aborted:
        return Outcome(kind, ABORTED, None if first is None else first - start)
    result, why = judge(tokens, ref, tie)
    return Outcome(kind, result, None if first is None else first - start, why)
