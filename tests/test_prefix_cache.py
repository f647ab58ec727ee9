"""Prefix caching on the tiny model: a request served from the cache computes what it would
have computed without it (deterministic mode: bit for bit), at every prompt length, with
chunked prefill, preemption, ReplaySSM, quantized caches and forced eviction."""

from __future__ import annotations

import random

import pytest

from oxserve.llm import LLM
from oxserve.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=3)
# One KDA checkpoint of the tiny model in fp32: 3 layers x (recurrent 2 x 16 x 16 + conv 3 x 96) x 4 B.
TINY_STATE_BYTES = 3 * (2 * 16 * 16 + 3 * 96) * 4


def _llm(tiny_model_dir, **options) -> LLM:
    base = dict(dtype="float32", block_size=4, max_model_len=512)
    return LLM(model=str(tiny_model_dir), **{**base, **options})


def _conversation(llm: LLM, first: list[int], followups: list[list[int]], max_tokens: int):
    """Turn after turn, each prompt the last one plus its output plus the next message."""
    outputs, prompt = [], list(first)
    for message in [[]] + followups:
        prompt = prompt + message
        (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=max_tokens, **GREEDY))
        outputs.append(out.outputs[0])
        prompt = prompt + out.outputs[0].token_ids
    return outputs


def test_a_continued_conversation_is_bit_equal_at_every_length(tiny_model_dir):
    """Deterministic mode: the second turn resumes at the first turn's last computed token
    (prompt + output - 1; a partial block copied, KDA states restored) for first prompts of
    every length from 1 token up, and yields the same tokens and logprobs, bit for bit."""
    rng = random.Random()
    cached, plain = (_llm(tiny_model_dir, deterministic=True, enable_prefix_caching=on) for on in (True, False))
    base = [rng.randrange(20, 8000) for _ in range(13)]
    for n in range(1, len(base) + 1):
        followup = [[rng.randrange(20, 8000) for _ in range(rng.randrange(1, 6))]]
        hits_before = cached.engine.stats().prefix_hits
        with_cache = _conversation(cached, base[:n], followup, max_tokens=3)
        assert cached.engine.stats().prefix_hits - hits_before >= n + 3 - 1, n
        without = _conversation(plain, base[:n], followup, max_tokens=3)
        for a, b in zip(with_cache, without):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs, n


def _assert_same_greedy(ours, reference, margin: float = 1e-4):
    """Same tokens, up to a pick that rounding can flip (top two within `margin` nats);
    logprobs agree to fp32 rounding before any such flip."""
    compared = 0
    for a, b in zip(ours, reference):
        differ = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        end = len(a.token_ids) if differ is None else differ
        for i in range(end):
            for token, lp in b.logprobs[i].items():
                assert a.logprobs[i][token] == pytest.approx(lp, abs=2e-4)
        if differ is not None:
            top = sorted(b.logprobs[differ].values(), reverse=True)
            assert top[0] - top[1] < margin, f"diverged at token {differ} with a margin of {top[0] - top[1]:.3g}"
        compared += end
    return compared


@pytest.mark.parametrize("kda_decode", ["write-back", "replay"])
@pytest.mark.parametrize("deterministic", [pytest.param(True, id="deterministic", marks=pytest.mark.slow),
                                           pytest.param(False, id="default")])
def test_concurrent_conversations_with_forced_eviction_match_no_cache(tiny_model_dir, no_top_k_model_dir, kda_decode,
                                                                      deterministic):
    """Many conversations behind a shared system prompt, sent together turn by turn, with a
    block pool that forces preemption and block eviction, a checkpoint pool of a few rows,
    and a token budget that chunks prompts. Deterministic mode with write-back KDA decode
    yields the same outputs bit for bit. Otherwise the computation differs by rounding (the
    chunking differs; a ReplaySSM checkpoint holds its ring folded into the state): the
    same greedy outputs, logprobs within fp32 rounding, on a model whose DSA selection keeps
    every pool and a router that picks every expert (a rounding-level difference may otherwise
    flip a top-k pick, cache or not)."""
    rng = random.Random()
    # Lengths bounded below so that eight later turns cannot all fit in 40 blocks of 4 tokens, even
    # sharing the system prompt (at least 7 blocks each of their own); the longest fits alone (34).
    system = [rng.randrange(20, 8000) for _ in range(rng.randrange(20, 40))]
    conversations = [[system + [rng.randrange(20, 8000) for _ in range(rng.randrange(10, 30))]] for _ in range(8)]
    for conv in conversations:
        conv += [[rng.randrange(20, 8000) for _ in range(rng.randrange(5, 20))] for _ in range(2)]
    options = dict(kda_decode=kda_decode, kda_replay_len=5, max_num_batched_tokens=24, num_blocks=40, max_num_seqs=8,
                   deterministic=deterministic)  # fmt: skip
    exact = deterministic and kda_decode == "write-back"
    model = tiny_model_dir if exact else no_top_k_model_dir
    output_lens = [rng.randrange(4, 12) for _ in range(3)]
    results = {}
    for on in (True, False):
        llm = _llm(model, enable_prefix_caching=on, prefix_checkpoint_gib=7 * TINY_STATE_BYTES / 2**30, **options)
        prompts = [list(conv[0]) for conv in conversations]
        outputs = []
        for turn in range(3):
            params = SamplingParams(max_tokens=output_lens[turn], **GREEDY)
            outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
            outputs += outs
            if turn < 2:
                prompts = [p + o.token_ids + conv[turn + 1] for p, o, conv in zip(prompts, outs, conversations)]
        results[on] = outputs
        if on:
            stats = llm.engine.stats()
            assert llm.engine.prefix_caching.state_bytes == TINY_STATE_BYTES
            assert stats.prefix_checkpoint_capacity == 7
            assert stats.prefix_hits > 0 and stats.num_preemptions > 0, stats
            assert stats.prefix_checkpoint_evictions > 0 and stats.prefix_block_evictions > 0, stats
    if exact:
        for a, b in zip(results[True], results[False]):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    else:
        assert _assert_same_greedy(results[True], results[False]) > 50


def test_quantized_caches_share_blocks_as_stored(tiny_model_dir):
    """An int8 latent cache with prefix caching: a resumed request copies stored values and
    scales (no requantization), so it decodes what it would without the cache."""
    rng = random.Random()
    prompt = [rng.randrange(20, 8000) for _ in range(rng.randrange(10, 30))]
    followup = [[rng.randrange(20, 8000) for _ in range(5)]]
    runs = [_conversation(_llm(tiny_model_dir, kv_cache_dtype="int8", deterministic=True, enable_prefix_caching=on),
                          prompt, followup, max_tokens=4) for on in (True, False)]  # fmt: skip
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_prompt_logprobs_are_computed_not_cached(tiny_model_dir):
    """A request that asks for prompt logprobs scores its whole prompt: it never resumes."""
    llm = _llm(tiny_model_dir)
    prompt = [random.randrange(20, 8000) for _ in range(20)]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2))
    hits = llm.engine.stats().prefix_hits
    (out,) = llm.generate([{"prompt_token_ids": prompt + [5]}], SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert len(out.prompt_logprobs) == len(prompt) + 1 and llm.engine.stats().prefix_hits == hits


def test_chat_boundaries_are_checkpointed(tiny_model_dir):
    """A chat prompt's state is saved before its role tokens: a second conversation with the
    same system prompt and another question resumes at the end of the system prompt."""
    llm = _llm(tiny_model_dir)
    system = {"role": "system", "content": "You are a terse assistant who answers in one word. " * 3}
    params = SamplingParams(max_tokens=2)
    first = llm.chat([system, {"role": "user", "content": "What colour is the sky?"}], params)
    hits = llm.engine.stats().prefix_hits
    second = llm.chat([system, {"role": "user", "content": "Name a fruit."}], params)
    tokenizer = llm.engine.tokenizer
    user = tokenizer.encode("<|user|>")[0]
    boundary = first[0].prompt_token_ids.index(user)
    assert second[0].prompt_token_ids[:boundary] == first[0].prompt_token_ids[:boundary]
    assert llm.engine.stats().prefix_hits - hits == boundary
