"""The OpenAI endpoints through the official `openai` client: shapes, streaming, stop strings,
n > 1, logprobs, usage, /v1/models, /health and /metrics."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import MAX_MODEL_LEN, server, tiny_model  # noqa: F401  (fixtures)

from oxserve import LLM, SamplingParams

PROMPT = "The engine serves"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def stream_text(chunks, field: str = "text") -> tuple[str, list, list]:
    """(concatenated text, finish reasons, usage objects) of a completion or chat stream."""
    text, reasons, usages = "", [], []
    for chunk in chunks:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            text += (choice.text if field == "text" else choice.delta.content) or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return text, reasons, usages


def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.client().models.list().data[0].id]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_completion_and_its_stream_agree(server):
    client = server.client()
    full = client.completions.create(model=None, prompt=PROMPT, max_tokens=12, **GREEDY)
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12

    chunks = list(client.completions.create(model=None, prompt=PROMPT, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))  # fmt: skip
    text, reasons, usages = stream_text(chunks)
    assert text == choice.text and reasons == ["length"]
    assert len(usages) == 1 and chunks[-1].choices == [] and usages[0].completion_tokens == 12
    assert all(c.id == chunks[0].id for c in chunks) and chunks[0].id.startswith("cmpl-")


def test_chat_and_its_stream_agree(server):
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    full = client.chat.completions.create(model=None, messages=messages, max_completion_tokens=10, **GREEDY)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    assert full.usage.completion_tokens == 10

    chunks = list(client.chat.completions.create(model=None, messages=messages, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text, reasons, usages = stream_text(chunks, field="content")
    assert text == message.content and reasons == ["length"]
    assert usages[0].completion_tokens == 10 and usages[0].prompt_tokens == full.usage.prompt_tokens


def test_token_id_prompt_and_batch_of_prompts(server):
    client = server.client()
    ids = [100, 200, 300, 400]
    single = client.completions.create(model=None, prompt=ids, max_tokens=5, **GREEDY)
    assert single.usage.prompt_tokens == 4
    batch = client.completions.create(model=None, prompt=[ids, [7, 8, 9]], max_tokens=5, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == single.choices[0].text
    assert batch.usage.prompt_tokens == 7 and batch.usage.completion_tokens == 10
    texts = client.completions.create(model=None, prompt=[PROMPT, "Hello"], max_tokens=5, **GREEDY)
    assert len(texts.choices) == 2 and texts.usage.completion_tokens == 10


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(server, stream):
    """Greedy output is known, so a stop string taken from its middle must end it right there."""
    client = server.client()
    text = client.completions.create(model=None, prompt=PROMPT, max_tokens=24, **GREEDY).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = text[: text.index(stop)]
    kwargs = {"model": None, "prompt": PROMPT, "max_tokens": 24, "stop": [stop], "logprobs": 0, **GREEDY}
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        got, reasons, usages = stream_text(chunks)
        tokens = sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices and c.choices[0].logprobs)
        usage = usages[0]
    else:
        out = client.completions.create(**kwargs)
        got, reasons, usage = out.choices[0].text, [out.choices[0].finish_reason], out.usage
        tokens = len(out.choices[0].logprobs.tokens)
    assert got == expected and reasons == ["stop"]
    # usage counts the tokens produced, the one completing the stop string included
    assert usage.completion_tokens == tokens < 24


def test_n_choices_are_seeded_samples(server):
    """With a seed, choice j of n equals a single request with seed + j (as vLLM's LLM.generate)."""
    client = server.client()
    kwargs = {"model": None, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    out = client.completions.create(n=3, seed=7, **kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.completion_tokens == 24
    for j, choice in enumerate(out.choices):
        assert choice.text == client.completions.create(n=1, seed=7 + j, **kwargs).choices[0].text
    chunks = list(client.chat.completions.create(model=None, messages=[{"role": "user", "content": "hi"}], n=2, seed=3,
                                                 max_tokens=6, stream=True, temperature=1.0))  # fmt: skip
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def test_completion_logprobs_shape(server):
    out = server.client().completions.create(model=None, prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4
        assert top[token] == logprob == max(top.values())  # greedy picks the most likely token


def test_chat_logprobs_shape(server):
    out = server.client().chat.completions.create(model=None, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY)  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert bytes(entry.bytes).decode() == entry.token
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob


def test_sampling_extras_are_accepted(server, tiny_model):
    """Each vLLM extra changes the tokens as it does offline, so one the server dropped fails."""

    def run(prompt, **body) -> tuple[list[int], str]:
        """Token ids and finish reason of a completion of at most 16 tokens; `body` is sent as is."""
        out = server.client().completions.create(model=None, prompt=prompt, max_tokens=16, logprobs=0,
                                                 extra_body={"return_tokens_as_token_ids": True, **body})  # fmt: skip
        choice = out.choices[0]
        return [int(token.removeprefix("token_id:")) for token in choice.logprobs.tokens], choice.finish_reason

    # top_k=1 and min_p=1.0 keep only the most likely token, so sampling gives the greedy tokens;
    # the random tiny model is near uniform, so without them the same seed does not.
    greedy, _ = run(PROMPT, temperature=0.0, ignore_eos=True)
    sampled = {"temperature": 1.0, "seed": 5, "ignore_eos": True}
    assert run(PROMPT, **sampled)[0] != greedy
    assert run(PROMPT, **sampled, top_k=1)[0] == greedy
    assert run(PROMPT, **sampled, min_p=1.0)[0] == greedy

    # repetition_penalty < 1 favours the tokens seen, here the prompt's EOS ids: greedy stops at one...
    eos_ids = json.loads((tiny_model / "generation_config.json").read_text())["eos_token_id"]
    prompt = [11, 12, 13, *eos_ids]
    penalised = {"temperature": 0.0, "repetition_penalty": 0.3}
    stopped, reason = run(prompt, **penalised)
    assert reason == "stop" and len(stopped) < 16 and stopped[-1] in eos_ids
    # ...and with ignore_eos runs on past it, the same tokens as offline, others than unpenalised.
    past_eos, reason = run(prompt, **penalised, ignore_eos=True)
    assert reason == "length" and past_eos[: len(stopped)] == stopped
    offline = LLM(model=str(tiny_model), dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=0.3, ignore_eos=True)
    assert past_eos == offline.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    assert past_eos != run(prompt, temperature=0.0, ignore_eos=True)[0]


def test_stop_token_ids_end_the_request(server):
    client = server.client()
    ids = client.completions.create(model=None, prompt=PROMPT, max_tokens=8, logprobs=0,
                                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, temperature=0.0)  # fmt: skip
    third = int(ids.choices[0].logprobs.tokens[2].removeprefix("token_id:"))
    out = client.completions.create(model=None, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [third]})  # fmt: skip
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 3


def test_metrics_parse(server):
    server.client().completions.create(model=None, prompt=PROMPT, max_tokens=3, **GREEDY)
    text = httpx.get(f"{server.base_url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("oxserve:num_requests_running", "oxserve:num_requests_waiting", "oxserve:kv_cache_usage_perc",
                 "oxserve:num_preemptions", "oxserve:prompt_tokens", "oxserve:generation_tokens",
                 "oxserve:time_to_first_token_seconds", "oxserve:time_per_output_token_seconds",
                 "oxserve:e2e_request_latency_seconds", "oxserve:spec_decode_num_drafts",
                 "oxserve:spec_decode_num_draft_tokens", "oxserve:spec_decode_num_accepted_tokens",
                 "oxserve:prefix_cache_queries", "oxserve:prefix_cache_hits", "oxserve:prefix_cache_requests",
                 "oxserve:prefix_cache_hit_requests", "oxserve:prefix_checkpoints", "oxserve:prefix_checkpoint_usage_perc",
                 "oxserve:prefix_checkpoint_evictions", "oxserve:prefix_cached_blocks", "oxserve:prefix_block_evictions"):  # fmt: skip
        assert name in families, name
    samples = server.metrics()
    assert samples["oxserve:generation_tokens_total"] >= 3
    assert samples["oxserve:prefix_cache_queries_total"] >= samples["oxserve:prefix_cache_hits_total"] >= 0
    assert samples["oxserve:e2e_request_latency_seconds_count"] >= 1
    assert httpx.get(f"{server.base_url}/metrics").headers["content-type"].startswith("text/plain")
    declared = httpx.get(f"{server.base_url}/openapi.json").json()["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(declared) == ["text/plain"]  # not the JSON FastAPI declares by default


def _completion(server, **body) -> dict:
    """A non-streaming completion as raw JSON (nulls and vLLM's extra fields as sent)."""
    response = httpx.post(f"{server.base_url}/v1/completions", json={"temperature": 0.0, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


SCORED_IDS = [300 + 7 * i for i in range(10)]


def test_echo_prepends_the_prompt_and_its_logprobs(server, tiny_model):
    """lm-eval's scoring request: the prompt's tokens first (the first one with null logprobs,
    nothing comes before it), then the sampled token; the values are the offline API's."""
    ids = SCORED_IDS
    choice = _completion(server, prompt=ids, echo=True, max_tokens=1, logprobs=1)["choices"][0]
    plain = _completion(server, prompt=ids, max_tokens=1, logprobs=1)["choices"][0]
    offline = LLM(model=str(tiny_model), dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    expected = offline.generate({"prompt_token_ids": ids}, params)[0].prompt_logprobs
    prompt_text = offline.tokenizer.decode(ids, skip_special_tokens=False)
    assert choice["text"] == prompt_text + plain["text"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for t in range(1, len(ids)):
        assert lp["token_logprobs"][t] == pytest.approx(expected[t][ids[t]], abs=1e-4)
        assert 1 <= len(lp["top_logprobs"][t]) <= 2
    assert lp["token_logprobs"][-1] == plain["logprobs"]["token_logprobs"][0]  # the sampled token, as without echo
    assert lp["text_offset"][:-1] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert lp["text_offset"][-1] == len(prompt_text)  # offsets count from the start of the echoed text


def test_echo_with_max_tokens_0_returns_each_prompt_alone(server):
    prompts = ["The engine serves", "A second prompt"]
    out = _completion(server, prompt=prompts, echo=True, max_tokens=0, logprobs=0, n=2)
    assert [c["text"] for c in out["choices"]] == [prompts[0], prompts[0], prompts[1], prompts[1]]
    for c in out["choices"]:
        lp = c["logprobs"]
        assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
        assert len(lp["tokens"]) == len(lp["text_offset"]) and "".join(lp["tokens"]) == c["text"]
    # Prompt tokens counted once per prompt; the one token per choice the engine samples anyway, as vLLM counts it.
    assert out["usage"]["completion_tokens"] == 4


def test_prompt_logprobs_field_has_vllms_shape(server):
    ids = SCORED_IDS
    choice = _completion(server, prompt=ids, max_tokens=2, prompt_logprobs=2)["choices"][0]
    echoed = _completion(server, prompt=ids, echo=True, max_tokens=0, logprobs=2)["choices"][0]["logprobs"]
    assert choice["logprobs"] is None and choice["text"] and not choice["text"].startswith(echoed["tokens"][0])
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for t in range(1, len(ids)):
        entry = scored[t]
        assert 2 <= len(entry) <= 3
        assert entry[str(ids[t])]["logprob"] == echoed["token_logprobs"][t]
        assert all(isinstance(v["decoded_token"], str) and v["rank"] >= 1 for v in entry.values())
        assert [v["rank"] for v in sorted(entry.values(), key=lambda v: -v["logprob"])][:2] == [1, 2]


def test_echo_stream_sends_the_prompt_first(server):
    body = {"prompt": PROMPT, "echo": True, "max_tokens": 5, "logprobs": 1, "ignore_eos": True}
    whole = _completion(server, **body)["choices"][0]
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json={**body, "temperature": 0.0, "stream": True},
                      timeout=60) as response:  # fmt: skip
        chunks = [json.loads(line[6:])["choices"][0] for line in response.iter_lines() if line.startswith("data: {")]
    # One chunk per step, except that a stream falling behind the engine sends the newest output
    # (several tokens) at once: the prompt's tokens and the first new one lead the first chunk.
    prompt_tokens = len(whole["logprobs"]["tokens"]) - 5
    assert chunks[0]["text"].startswith(PROMPT) and len(chunks[0]["logprobs"]["tokens"]) > prompt_tokens
    assert len(chunks) <= 5
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in chunks for v in c["logprobs"][key]] == whole["logprobs"][key], key
