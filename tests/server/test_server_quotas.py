"""Per-key quotas (--api-keys) through the official openai client: OpenAI's rate-limit headers,
429s that name the limit reached with a Retry-After that is right, tokens charged at
max_tokens and given back when a generation stops short, concurrency limits, per-key metrics."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import serve, tiny_model  # noqa: F401  (tiny_model: fixture)

from oxserve.server.quotas import Bucket, duration, load_keys

KEYS = """
keys:
  sk-rpm: {name: rpm, requests_per_minute: 3}
  sk-tpm: {name: tpm, tokens_per_minute: 60}
  sk-one: {name: one, max_concurrent: 1}
  sk-free: {name: free}
"""
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _client(s, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{s.base_url}/v1", api_key=key, max_retries=0)


def _limited(s) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{s.base_url}/metrics").text
    return {(x.labels["key"], x.labels["limit"]): x.value for f in text_string_to_metric_families(text) for x in f.samples
            if x.name == "oxserve:key_rate_limited_total"}  # fmt: skip


def _wait_idle(s, name: str) -> None:
    """Until the key has no request in flight (a closed stream ends on the server a moment later)."""
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(f"{s.base_url}/metrics").text
        if all(x.value == 0 for f in text_string_to_metric_families(text) for x in f.samples
               if x.name == "oxserve:key_requests_in_flight" and x.labels["key"] == name):  # fmt: skip
            return
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _remaining_tokens(s) -> int:
    """Read with a GET (it takes no request and no tokens)."""
    r = httpx.get(f"{s.base_url}/v1/models", headers={"Authorization": "Bearer sk-tpm"})
    return int(r.headers["x-ratelimit-remaining-tokens"])


def test_bucket_refills_continuously_and_reports_when_a_request_fits():
    bucket = Bucket(60, now=0.0)
    assert bucket.take(50, now=0.0) and not bucket.take(20, now=0.0)
    assert bucket.seconds_until(20, now=0.0) == pytest.approx(10.0)  # 1 token per second
    assert bucket.level(now=5.0) == pytest.approx(15.0)
    bucket.give_back(100, now=5.0)
    assert bucket.level(now=5.0) == 60, "never above the limit"
    assert [duration(x) for x in (0.12, 1.0, 59.2, 360.0)] == ["120ms", "1s", "1m0s", "6m0s"]


@pytest.mark.parametrize("text, message", [
    ("keys: {}", "non-empty 'keys:'"),
    ("keys: {k: {requests_per_minute: 0}}", "positive integer"),
    ("keys: {k: {rpm: 5}}", "unknown fields"),
    ("keys: {a: {name: x}, b: {name: x}}", "unique"),
    ("keys: [", "cannot read"),
])  # fmt: skip
def test_a_bad_keys_file_is_refused_with_the_reason(tmp_path, text, message):
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_keys(path)


def test_quotas_warn_then_refuse_and_name_the_limit(tiny_model, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text(KEYS)
    with serve(tiny_model, "--api-keys", str(keys), log_dir=tmp_path) as s:
        with pytest.raises(openai.AuthenticationError):
            _client(s, "sk-unknown").models.list()
        model = _client(s, "sk-free").models.list().data[0].id
        free = _client(s, "sk-free").completions.with_raw_response.create(model=model, prompt=[11, 12], max_tokens=2)
        assert not any(h.startswith("x-ratelimit") for h in free.headers), "no limits, no headers"

        # Requests per minute: the headers count down, the fourth is refused for ~20 s.
        rpm = _client(s, "sk-rpm")
        seen = []
        for _ in range(3):
            r = rpm.completions.with_raw_response.create(model=model, prompt=[11, 12], max_tokens=2)
            assert r.headers["x-ratelimit-limit-requests"] == "3" and "x-ratelimit-limit-tokens" not in r.headers
            seen.append(int(r.headers["x-ratelimit-remaining-requests"]))
        assert seen == [2, 1, 0]
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
        with pytest.raises(openai.RateLimitError) as e:
            rpm.completions.create(model=model, prompt=[11, 12], max_tokens=2)
        assert e.value.code == "rate_limit_exceeded" and "requests per minute" in e.value.message and "'rpm'" in e.value.message
        assert 15 <= int(e.value.response.headers["retry-after"]) <= 20
        assert rpm.models.list().data, "a GET takes no request"

        # Tokens per minute: a generation takes prompt + max_tokens; a stream cut short gives
        # back what it did not generate.
        tpm = _client(s, "sk-tpm")
        assert _remaining_tokens(s) == 60
        stream = tpm.completions.create(model=model, prompt=[11, 12, 13, 14, 15], max_tokens=40, stream=True, extra_body=GREEDY)
        next(iter(stream))
        assert _remaining_tokens(s) <= 60 - 45 + 5, "the whole of max_tokens is taken up front"
        stream.close()
        deadline = time.monotonic() + 10
        while _remaining_tokens(s) < 45:  # without the refund it would take 30 s to get there
            assert time.monotonic() < deadline, "the tokens the aborted stream did not generate never came back"
            time.sleep(0.1)
        with pytest.raises(openai.BadRequestError, match="over key 'tpm'"):
            tpm.completions.create(model=model, prompt=[11, 12], max_tokens=59, extra_body=GREEDY)
        tpm.completions.create(model=model, prompt=[11] * 10, max_tokens=30, extra_body=GREEDY)  # 40 of ~50 left
        with pytest.raises(openai.RateLimitError) as e:
            tpm.completions.create(model=model, prompt=[11] * 10, max_tokens=30, extra_body=GREEDY)
        assert "tokens per minute" in e.value.message and int(e.value.response.headers["retry-after"]) >= 20

        # Concurrency: a second request while a stream runs is refused at once.
        one = _client(s, "sk-one")
        with one.completions.create(model=model, prompt=[11, 12], max_tokens=60, stream=True, extra_body=GREEDY) as running:
            next(iter(running))
            with pytest.raises(openai.RateLimitError, match="concurrent requests"):
                one.completions.create(model=model, prompt=[11, 12], max_tokens=2)
        _wait_idle(s, "one")
        assert one.completions.create(model=model, prompt=[11, 12], max_tokens=2).usage.completion_tokens == 2

        limited = _limited(s)
        assert limited[("rpm", "requests_per_minute")] == 1 and limited[("tpm", "tokens_per_minute")] == 1
        assert limited[("one", "concurrent_requests")] == 1
        assert s.metrics()["oxserve:num_requests_running"] == 0
