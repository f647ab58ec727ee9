"""--api-key (from $OXSERVE_API_KEY here) over real HTTP: the official client with and without the
key, the 401's shape, the open /health and /metrics; /tokenize, /detokenize and /v1/models."""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_harness import MAX_MODEL_LEN, ServerProcess, serve, tiny_model  # noqa: F401  (tiny_model: a fixture)
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from oxserve.server.auth import RequireAPIKey
from oxserve.server.cli import add_arguments, api_keys_from
from oxserve.tokenizer import Tokenizer

KEY = secrets.token_urlsafe(24)
NAME = "org/tiny-glm"  # a slash, as in hub names: /v1/models/{model} must take it
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("logs")
    with serve(tiny_model, "--served-model-name", NAME, log_dir=logs, env={"OXSERVE_API_KEY": KEY}) as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model)


def client(server: ServerProcess, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=api_key, max_retries=0)


def post(server: ServerProcess, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=30)


def test_the_client_with_the_key_completes(server):
    out = client(server, KEY).completions.create(model=NAME, prompt="The engine serves", max_tokens=4, temperature=0.0)
    assert out.usage.completion_tokens == 4


@pytest.mark.parametrize("api_key", ["wrong-key", KEY + "x", KEY[:-1]])
def test_the_client_with_a_wrong_key_gets_401(server, api_key):
    # (The client refuses to send no key at all; test_401_shape_and_header sends none.)
    with pytest.raises(openai.AuthenticationError) as e:
        client(server, api_key).completions.create(model=NAME, prompt="hi", max_tokens=1)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"


@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}])  # fmt: skip
def test_401_shape_and_header(server, path, headers):
    method = "GET" if path == "/v1/models" else "POST"
    r = httpx.request(method, f"{server.base_url}{path}", json={}, headers=headers)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key" and error["param"] is None
    assert KEY not in r.text


def test_health_and_metrics_are_open_and_the_key_is_never_logged(server):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    metrics = httpx.get(f"{server.base_url}/metrics")
    assert metrics.status_code == 200 and "oxserve:" in metrics.text
    # The bearer scheme is case-insensitive (RFC 7235).
    assert httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert "1 API key(s) required (from OXSERVE_API_KEY)" in server.log() and KEY not in server.log()


def test_models_card_and_retrieve(server):
    models = client(server, KEY).models.list()
    [card] = models.data
    assert card.id == NAME and card.root == NAME and card.max_model_len == MAX_MODEL_LEN  # root: no host path
    assert client(server, KEY).models.retrieve(NAME).model_dump(exclude={"created"}) == card.model_dump(exclude={"created"})
    with pytest.raises(openai.NotFoundError) as e:
        client(server, KEY).models.retrieve("no-such-model")
    assert e.value.code == "model_not_found"
    r = httpx.get(f"{server.base_url}/v1/models/no/such", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_tokenize_a_prompt_and_detokenize_it_back(server, tokenizer):
    prompt = "The engine serves tokens, fast: 1234 ünïcode"
    r = post(server, "/tokenize", {"model": NAME, "prompt": prompt, "add_special_tokens": True})
    assert r.status_code == 200, r.text
    tokens = tokenizer.encode(prompt)
    assert r.json() == {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens}
    assert post(server, "/detokenize", {"model": NAME, "tokens": tokens}).json() == {"prompt": prompt}

    with_strs = post(server, "/tokenize", {"prompt": prompt, "return_token_strs": True}).json()
    assert with_strs["tokens"] == tokens
    assert with_strs["token_strs"] == [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]


def test_tokenize_messages_as_the_chat_endpoint_renders_them(server, tokenizer):
    for add_generation_prompt in (True, False):
        r = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": add_generation_prompt})
        assert r.status_code == 200, r.text
        tokens = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt))
        assert r.json()["tokens"] == tokens and r.json()["count"] == len(tokens)
    # The chat endpoint counts the same prompt.
    chat = client(server, KEY).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=1)
    assert chat.usage.prompt_tokens == post(server, "/tokenize", {"messages": MESSAGES}).json()["count"]
    # Special tokens survive the round trip (the template's markup).
    text = tokenizer.apply_chat_template(MESSAGES, True)
    assert post(server, "/detokenize", {"tokens": tokenizer.encode(text)}).json() == {"prompt": text}


@pytest.mark.parametrize(("path", "body", "status", "words"), [
    ("/detokenize", {"tokens": [1, -1]}, 400, "-1 is outside the vocabulary"),
    ("/detokenize", {"tokens": [8192]}, 400, "8192 is outside the vocabulary"),
    ("/detokenize", {"tokens": ["1"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, "does not exist"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {}, 400, "either prompt or messages"),
    ("/tokenize", {"prompt": "hi", "messages": MESSAGES}, 400, "either prompt or messages"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": "hi", "return_token_strs": "yes"}, 400, "return_token_strs"),
    ("/tokenize", {"prompt": "hi", "model": "other"}, 404, "does not exist"),
])  # fmt: skip
def test_bad_tokenize_and_detokenize_bodies(server, path, body, status, words):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and set(error) == {"message", "type", "param", "code"}


def test_middleware_can_cover_metrics_and_streams_through():
    """RequireAPIKey alone, in process: --api-key-protects-metrics closes /metrics, and a stream
    passes through chunk by chunk."""

    async def chunks():
        for i in range(3):
            yield f"data: {i}\n\n"

    routes = [Route("/health", lambda r: PlainTextResponse("ok")), Route("/metrics", lambda r: PlainTextResponse("m")),
              Route("/v1/stream", lambda r: StreamingResponse(chunks(), media_type="text/event-stream"))]  # fmt: skip
    app = RequireAPIKey(Starlette(routes=routes), api_keys=[KEY], protect_metrics=True)
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).text == "m"
        with http.stream("GET", "/v1/stream", headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            assert "".join(r.iter_text()) == "data: 0\n\ndata: 1\n\ndata: 2\n\n"


def test_the_key_comes_from_the_flag_else_the_environment(monkeypatch):
    parser = argparse.ArgumentParser()
    add_arguments(parser, "serve")
    monkeypatch.setenv("OXSERVE_API_KEY", "from-env")
    assert list(api_keys_from(parser.parse_args(["--api-key", "from-flag"]))) == ["from-flag"]
    assert list(api_keys_from(parser.parse_args([]))) == ["from-env"]
    for bad in ("", "two words", "ключ"):
        with pytest.raises(SystemExit, match="visible ASCII"):
            api_keys_from(parser.parse_args(["--api-key", bad]))
    monkeypatch.delenv("OXSERVE_API_KEY")
    assert api_keys_from(parser.parse_args([])) is None
    with pytest.raises(SystemExit, match="needs an API key"):
        api_keys_from(parser.parse_args(["--api-key-protects-metrics"]))


def test_bench_serve_sends_the_key(server):
    cmd = [sys.executable, "-m", "oxserve.cli", "bench", "serve", "--base-url", server.base_url, "--api-key", KEY, "--json",
           "--num-prompts", "2", "--random-input-len", "8", "--random-output-len", "2", "--disable-tqdm"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["completed"] == 2
