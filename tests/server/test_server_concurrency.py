"""Concurrency never corrupts a request.

64 greedy requests of mixed prompt and output lengths go in at once to a server whose cache
holds only 128 tokens (32 blocks of 4), so requests are preempted and recomputed while
others run. Each answer is then checked against the same request run alone:

- `--deterministic` (batch-invariant: every token computed alone): bitwise the same tokens
  and logprobs as the request sent alone to the same server.
- default mode, where batching changes float reduction order: by teacher forcing against
  an `LLMEngine` running each request alone with `logprobs=20`. Walking the served tokens,
  each must be the alone run's argmax, or tie with it: logprob gaps are logit gaps, and the
  gap must be <= 1e-4 absolute (this checkpoint's max |logit| is about 0.6, so this is a
  little looser than 1e-4 relative to max |logit|). Its served logprob must match the alone run's within
  1e-3. On a tie the alone run is restarted from the served prefix, so later tokens are
  compared in the context the server actually had. Everything runs in float32. This
  test's checkpoint keeps every token in sparse attention (see `tiny_dense_dsa_model`):
  DSA's top-k over ReLU scores that tie at exactly 0 would otherwise turn ulp-level batch
  noise into ~1e-2 logprob differences that say nothing about corruption; the
  deterministic test covers the sparse selection bitwise.
"""

from __future__ import annotations

import asyncio
import random

import openai
import pytest
from server_harness import MAX_MODEL_LEN, serve, tiny_dense_dsa_model, tiny_model  # noqa: F401  (the models: fixtures)

from oxserve.config import CacheConfig, EngineConfig, ModelConfig
from oxserve.engine.engine import LLMEngine
from oxserve.sampling_params import SamplingParams

SMALL_CACHE = ("--block-size", "4", "--num-blocks", "32")
NUM_REQUESTS = 64
TIE_TOL = 1e-4
LOGPROB_TOL = 1e-3


def workload() -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    return [([rng.randrange(100, 8000) for _ in range(rng.randint(4, 24))], rng.randint(2, 12)) for _ in range(NUM_REQUESTS)]


async def complete(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int) -> tuple[list[int], list[dict]]:
    """(token ids, per-token {token id: logprob}) of one greedy completion."""
    out = await client.completions.create(
        model=None, prompt=prompt, max_tokens=max_tokens, temperature=0.0, logprobs=2,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    lp = out.choices[0].logprobs
    as_id = lambda token: int(token.removeprefix("token_id:"))  # noqa: E731
    ids = [as_id(t) for t in lp.tokens]
    assert out.usage.completion_tokens == len(ids) == max_tokens
    return ids, [{as_id(t): v for t, v in top.items()} for top in lp.top_logprobs]


async def run_concurrently(server, requests) -> list:
    client = server.async_client(timeout=600)
    return await asyncio.gather(*(complete(client, p, m) for p, m in requests))


async def run_alone(server, requests) -> list:
    client = server.async_client(timeout=600)
    return [await complete(client, p, m) for p, m in requests]


@pytest.mark.slow
def test_deterministic_mode_is_bitwise_batch_invariant(tiny_model, tmp_path):
    requests = workload()
    with serve(tiny_model, "--deterministic", *SMALL_CACHE, log_dir=tmp_path) as s:
        together = asyncio.run(run_concurrently(s, requests))
        assert s.metrics()["oxserve:num_preemptions_total"] > 0
        alone = asyncio.run(run_alone(s, requests))
    for i, (got, want) in enumerate(zip(together, alone)):
        assert got == want, f"request {i} differs when batched"


@pytest.mark.slow
def test_default_mode_matches_alone_runs_by_teacher_forcing(tiny_dense_dsa_model, tmp_path):
    requests = workload()
    with serve(tiny_dense_dsa_model, *SMALL_CACHE, log_dir=tmp_path) as s:
        together = asyncio.run(run_concurrently(s, requests))
        assert s.metrics()["oxserve:num_preemptions_total"] > 0
    reference = AloneRunner(tiny_dense_dsa_model)
    for i, ((prompt, _), (tokens, logprobs)) in enumerate(zip(requests, together)):
        reference.check(i, prompt, tokens, logprobs)


class AloneRunner:
    def __init__(self, model):
        config = EngineConfig(model=ModelConfig(model=str(model), dtype="float32", max_model_len=MAX_MODEL_LEN),
                              cache=CacheConfig(cache_memory_gib=0.05))  # fmt: skip
        self.engine = LLMEngine(config)
        self.count = 0

    def generate(self, prompt: list[int], max_tokens: int) -> list[tuple[int, dict[int, float]]]:
        self.count += 1
        rid = self.engine.add_request(f"alone-{self.count}", prompt, SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=20))  # fmt: skip
        final = None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.request_id == rid and out.finished:
                    final = out.outputs[0]
        return list(zip(final.token_ids, final.logprobs))

    def check(self, i: int, prompt: list[int], served: list[int], served_logprobs: list[dict[int, float]]) -> None:
        pos = 0
        while pos < len(served):
            for token, alone in self.generate(prompt + served[:pos], len(served) - pos):
                best = max(alone.values())
                got = served[pos]
                assert got in alone and best - alone[got] <= TIE_TOL, f"request {i} token {pos}: {got} is not the argmax {token}"
                assert abs(served_logprobs[pos][got] - alone[got]) <= LOGPROB_TOL, f"request {i} token {pos}: logprob"
                pos += 1
                if got != token:
                    break  # a tie went the other way: continue from the served prefix
