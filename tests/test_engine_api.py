"""The Python API and engine behaviour: validation, stopping, sampling controls, abort."""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer

from oxserve import LLM, RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(model=str(tiny_model_dir), dtype="float32", max_model_len=256)


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize(
    "make",
    [
        lambda: SamplingParams(max_tokens=0),
        lambda: SamplingParams(max_tokens=-3),
        lambda: SamplingParams(temperature=-0.5),
        lambda: SamplingParams(top_p=0.0),
        lambda: SamplingParams(top_p=1.5),
        lambda: SamplingParams(top_k=-2),
        lambda: SamplingParams(min_p=1.2),
        lambda: SamplingParams(presence_penalty=3.0),
        lambda: SamplingParams(frequency_penalty=-2.5),
        lambda: SamplingParams(repetition_penalty=0.0),
        lambda: SamplingParams(logprobs=-1),
        lambda: SamplingParams(n=0),
        lambda: SamplingParams(stop=[""]),
    ],
)
def test_out_of_range_sampling_values_are_rejected(make):
    with pytest.raises(ValueError) as err:
        make()
    assert "must" in str(err.value)


@pytest.mark.parametrize(
    "prompt,needle",
    [
        ("", "empty"),
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [5, 8192, 7]}, "outside the vocabulary"),
        ({"prompt_token_ids": [5, -1]}, "outside the vocabulary"),
        ({"prompt_token_ids": list(range(10, 300))}, "max_model_len"),
        ({"prompt_token_ids": [1.5, 2]}, "integers"),
        ({"nothing": 1}, "prompt_token_ids"),
        (3.14, "prompt is"),
    ],
)
def test_bad_prompts_raise_and_in_flight_requests_finish(llm, prompt, needle):
    engine = llm.engine
    good = [{"prompt_token_ids": [11, 12, 13, 14]}, "a second prompt"]
    alone = llm.generate(good, GREEDY)
    ids = [engine.add_request(None, p, GREEDY) for p in good]
    engine.step()
    with pytest.raises(ValueError) as err:
        engine.add_request(None, prompt, GREEDY)
    assert needle in str(err.value)
    with pytest.raises(ValueError):
        llm.generate([good[0], prompt], GREEDY)  # validated up front: nothing queued
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [done[i].outputs[0].token_ids for i in ids] == [a.outputs[0].token_ids for a in alone]
    assert engine.cache.num_holders == 0 and engine.cache.usage == 0.0  # blocks only checkpoints pin are a cache


def test_generation_stops_at_max_model_len(llm):
    out = llm.generate({"prompt_token_ids": list(range(10, 250))}, SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 16 and out[0].outputs[0].finish_reason == "length"


def test_stop_string_cuts_the_text(llm):
    prompt = "the quick brown fox"
    base = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    text = base.text
    assert len(text) > 6
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    )[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_stop_token_ids_and_eos(llm):
    base = llm.generate("hello", GREEDY)[0].outputs[0].token_ids
    stop_id = base[5]
    out = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id]))
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_id
    assert completion.token_ids == base[: base.index(stop_id) + 1]


def test_logprobs_hold_the_sampled_token_and_top_n(llm):
    out = llm.generate("logprobs", SamplingParams(temperature=0.8, max_tokens=8, logprobs=3, seed=1))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and 3 <= len(lp) <= 4
        assert all(v <= 0.0 for v in lp.values())


def test_seeded_sampling_repeats_and_n_children_differ(llm):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=42, n=3, ignore_eos=True)
    first = llm.generate("seeded", params)[0]
    second = llm.generate("seeded", params)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    assert [c.index for c in first.outputs] == [0, 1, 2]


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
]


@pytest.mark.parametrize(
    "messages,add_generation_prompt,expected_prompt",
    [
        # A past assistant turn without reasoning closes the block at once; the generation prompt opens one.
        ([{"role": "user", "content": "hi"}], True, "[gMASK]<sop><|user|>\nhi<|assistant|><think>"),
        (CONVERSATION, True, "[gMASK]<sop><|system|>\nBe brief.<|user|>\nhi<|assistant|></think>hello<|assistant|><think>"),
        (CONVERSATION, False, "[gMASK]<sop><|system|>\nBe brief.<|user|>\nhi<|assistant|></think>hello"),
    ],
    ids=["user", "conversation", "conversation-without-generation-prompt"],
)
def test_chat_applies_the_template(llm, tiny_model_dir, messages, add_generation_prompt, expected_prompt):
    """Expected prompts are written out by hand from the default model's CHAT_TEMPLATE and
    tokenized by the `tokenizers` library itself, so no oxserve code computes them."""
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    expected_ids = tokenizer.encode(expected_prompt, add_special_tokens=False).ids
    # The template's markers are single special tokens, not spelled out in pieces.
    assert expected_ids[:2] == [tokenizer.token_to_id("[gMASK]"), tokenizer.token_to_id("<sop>")]

    out = llm.chat(messages, SamplingParams(max_tokens=1, temperature=0.0), add_generation_prompt=add_generation_prompt)

    assert out[0].prompt == expected_prompt
    assert out[0].prompt_token_ids == expected_ids


def test_abort_frees_the_request(llm):
    engine = llm.engine
    a = engine.add_request(None, "keep going", GREEDY)
    b = engine.add_request(None, "stop me", SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    aborted = engine.abort_request(b)
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert engine.abort_request(b) is None
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.cache.num_holders == 0
    assert a not in engine.scheduler.requests and not engine.scheduler.requests  # everything retired


def test_deterministic_mode_is_batch_invariant(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", deterministic=True, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    target = {"prompt_token_ids": list(range(100, 140))}
    alone = llm.generate(target, params)[0].outputs[0]
    crowd = llm.generate([{"prompt_token_ids": list(range(200, 200 + n))} for n in (3, 90, 17)] + [target], params)
    together = crowd[-1].outputs[0]
    assert together.token_ids == alone.token_ids
    assert together.logprobs == alone.logprobs  # bitwise


def test_priorities_need_the_priority_policy(llm):
    """As vLLM: a priority other than 0 is an error under fcfs, and it must fit 32 bits."""
    with pytest.raises(ValueError, match="--scheduling-policy fcfs"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), priority=[1])
    with pytest.raises(ValueError, match="1 priorities for 2 prompts"):
        llm.generate([[5, 6], [7, 8]], SamplingParams(max_tokens=2), priority=[0])
    assert not llm.engine.has_unfinished_requests()


def test_the_priority_policy_serves_the_most_urgent_first(tiny_model_dir):
    """One running place: first tokens come in priority order, not in the order the prompts
    were given; the answers are what fcfs gives (greedy)."""
    prompts = [[20 + i, 30 + i, 40 + i] for i in range(5)]
    urgency = [3, -1, 2, 0, -1]
    first_token_times = {}
    ranked = LLM(model=str(tiny_model_dir), dtype="float32", max_num_seqs=1, scheduling_policy="priority")
    outs = ranked.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), priority=urgency)
    for i, out in enumerate(outs):
        first_token_times[i] = out.metrics["first_token_time"]
    assert sorted(first_token_times, key=first_token_times.get) == sorted(range(5), key=lambda i: (urgency[i], i))
    plain = LLM(model=str(tiny_model_dir), dtype="float32", max_num_seqs=1)
    expected = plain.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]


@pytest.fixture(scope="module")
def uncached_llm(tiny_model_dir) -> LLM:
    """Prefix caching off: a second run of a prompt would resume from the first's states,
    whose sums are not the same to the last bit."""
    return LLM(model=str(tiny_model_dir), dtype="float32", max_model_len=256, enable_prefix_caching=False)


def _run_alone(llm: LLM, prompt: list[int], params: SamplingParams) -> list:
    llm.engine.add_request("kind", prompt, params)
    outputs = []
    while llm.engine.has_unfinished_requests():
        outputs += llm.engine.step()
    return outputs


def _stop_across_tokens(pieces: list[str]) -> str | None:
    """Two characters that two consecutive tokens' texts join into, appearing first past the
    first token's text: a stop string that ends a run after its first output, and before its
    last, whose start an earlier output may hold."""
    text = "".join(pieces)
    for j in range(2, len(pieces) - 1):
        if pieces[j - 1] and pieces[j]:
            stop = pieces[j - 1][-1] + pieces[j][0]
            if text.find(stop) >= len(pieces[0]):
                return stop
    return None


def test_output_kinds_carry_the_same_request(uncached_llm):
    """CUMULATIVE: everything so far, every step; DELTA: only what earlier outputs did not
    carry (the prompt's logprobs in the first; the possible start of a stop string held back);
    FINAL_ONLY: one output, at the end. The same tokens, text and logprobs in the end, without
    a stop string (tokens decoded when the text is read) and with one across two tokens
    (decoded as they come)."""
    seed = random.randrange(2**63)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(20, 200, (int(torch.randint(3, 40, (), generator=gen)),), generator=gen).tolist()
    base = dict(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    pieces = [o.outputs[0].text for o in _run_alone(uncached_llm, prompt, SamplingParams(**base, output_kind=RequestOutputKind.DELTA))]
    stop = _stop_across_tokens(pieces)
    assert stop is not None, (seed, pieces)
    for stop in ([], [stop]):
        runs = {kind: _run_alone(uncached_llm, prompt, SamplingParams(**base, stop=stop, output_kind=kind))
                for kind in RequestOutputKind}  # fmt: skip
        cumulative, deltas, final = (runs[k] for k in RequestOutputKind)
        whole = cumulative[-1]
        assert not stop or whole.outputs[0].stop_reason == stop[0], (seed, pieces, stop)
        assert len(final) == 1 and final[0].finished and len(cumulative) == len(deltas) > 1
        assert [o.finished for o in cumulative] == [o.finished for o in deltas] == [False] * (len(deltas) - 1) + [True]
        for earlier, later in zip(cumulative, cumulative[1:]):
            assert later.outputs[0].token_ids[: len(earlier.outputs[0].token_ids)] == earlier.outputs[0].token_ids
        assert final[0].outputs[0] == whole.outputs[0] and final[0].prompt_logprobs == whole.prompt_logprobs
        assert [t for o in deltas for t in o.outputs[0].token_ids] == whole.outputs[0].token_ids
        assert [p for o in deltas for p in o.outputs[0].logprobs] == whole.outputs[0].logprobs
        assert "".join(o.outputs[0].text for o in deltas) == whole.outputs[0].text
        assert deltas[0].prompt_logprobs == whole.prompt_logprobs and all(o.prompt_logprobs is None for o in deltas[1:])
        if stop:
            assert len(whole.outputs[0].token_ids) < 30


def test_generate_returns_what_a_cumulative_request_ends_with(uncached_llm):
    """`LLM.generate` asks for final outputs only; they are what a request that streams
    everything ends with."""
    llm = uncached_llm
    prompt = torch.randint(20, 200, (17,), generator=torch.Generator().manual_seed(random.randrange(2**63))).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)
    assert llm.generate([prompt], params)[0].outputs[0] == _run_alone(llm, prompt, params)[-1].outputs[0]


def test_output_kind_must_be_one_of_three():
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY
    for bad in (3, True, "DELTA"):
        with pytest.raises(ValueError, match="output_kind must be one of"):
            SamplingParams(output_kind=bad)
