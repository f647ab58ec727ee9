"""The Responses API (/v1/responses) through the official `openai` client: text, reasoning,
forced function calls and their outputs in a follow-up turn, JSON schema outputs, the typed
stream events, background responses (polled, re-attached from a sequence number, cancelled),
deletion, and the errors for what it does not take. One server for the module."""

from __future__ import annotations

import json
import re
import signal
import time

import httpx
import jsonschema
import openai
import pytest
from openai.types import responses as rt
from server_harness import AGENT_ARGS, serve, tiny_model  # noqa: F401  (tiny_model: a fixture)

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather forecast for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
    },
}
FORCED = {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False}
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 10}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}
# The typed class of each event type the server sends.
EVENT_TYPES = {
    "response.created": rt.ResponseCreatedEvent,
    "response.in_progress": rt.ResponseInProgressEvent,
    "response.output_item.added": rt.ResponseOutputItemAddedEvent,
    "response.output_item.done": rt.ResponseOutputItemDoneEvent,
    "response.content_part.added": rt.ResponseContentPartAddedEvent,
    "response.content_part.done": rt.ResponseContentPartDoneEvent,
    "response.output_text.delta": rt.ResponseTextDeltaEvent,
    "response.output_text.done": rt.ResponseTextDoneEvent,
    "response.reasoning_text.delta": rt.ResponseReasoningTextDeltaEvent,
    "response.reasoning_text.done": rt.ResponseReasoningTextDoneEvent,
    "response.function_call_arguments.delta": rt.ResponseFunctionCallArgumentsDeltaEvent,
    "response.function_call_arguments.done": rt.ResponseFunctionCallArgumentsDoneEvent,
    "response.completed": rt.ResponseCompletedEvent,
    "response.incomplete": rt.ResponseIncompleteEvent,
}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with serve(tiny_model, *AGENT_ARGS, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def create(client, input="What is the weather in Paris?", thinking=False, **kw):
    extra = {**({} if thinking else NO_THINKING), **kw.pop("extra_body", {})}
    return client.responses.create(model=None, input=input, extra_body=extra, **kw)


def checked(events) -> list:
    """The stream's events, each of its typed class, numbered 0, 1, ... in order."""
    events = list(events)
    for event in events:
        assert isinstance(event, EVENT_TYPES[event.type]), event
    return events


def texts(events, kind: str = "response.output_text.delta") -> str:
    return "".join(e.delta for e in events if e.type == kind)


def wait_for(client, response_id: str, statuses=("completed", "incomplete", "cancelled", "failed")):
    deadline = time.monotonic() + 30
    while (r := client.responses.retrieve(response_id)).status not in statuses:
        assert time.monotonic() < deadline, r
        time.sleep(0.05)
    return r


def test_text_response_and_its_stream_agree(client):
    kw = {"temperature": 0.0, "max_output_tokens": 10, "extra_body": {"ignore_eos": True}, "metadata": {"k": "v"}}
    r = create(client, instructions="Answer briefly.", **kw)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert r.output_text and message.content[0].annotations == []
    assert r.usage.output_tokens == 10 and r.usage.total_tokens == r.usage.input_tokens + 10
    assert (r.temperature, r.metadata, r.store, r.background, r.instructions) == (0.0, {"k": "v"}, True, False, "Answer briefly.")

    events = checked(create(client, instructions="Answer briefly.", stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert texts(events) == events[-4].text == r.output_text == events[-1].response.output_text
    assert client.responses.retrieve(events[-1].response.id).output_text == r.output_text


def test_reasoning_is_an_output_item_streamed_or_not(client):
    kw = {"temperature": 0.0, "max_output_tokens": 12, "extra_body": {"ignore_eos": True}, "thinking": True}
    r = create(client, **kw)
    reasoning = r.output[0]
    assert reasoning.type == "reasoning" and reasoning.content[0].type == "reasoning_text"
    events = checked(create(client, stream=True, **kw))
    assert texts(events, "response.reasoning_text.delta") == reasoning.content[0].text
    assert texts(events) == r.output_text
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens > 0


def test_forced_function_call_then_its_output_via_previous_response_id(client):
    first = create(client, temperature=1.0, max_output_tokens=60, extra_body={"seed": 3}, **FORCED)
    assert first.status == "completed"
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert first.tools[0].name == "get_weather" and first.tool_choice.name == "get_weather"

    events = checked(create(client, temperature=1.0, max_output_tokens=60, extra_body={"seed": 3}, stream=True, **FORCED))
    assert texts(events, "response.function_call_arguments.delta") == call.arguments
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    second = create(client, input=[result], previous_response_id=first.id, temperature=0.0, max_output_tokens=4, tools=[WEATHER])
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    # the whole first turn (its question and its call) and the result are in the prompt
    assert second.usage.input_tokens > first.usage.input_tokens + 5


def test_json_schema_text_format(client):
    fmt = {"format": {"type": "json_schema", "name": "verdict", "schema": SCHEMA, "strict": True}}
    for seed in range(2):
        r = create(client, text=fmt, temperature=1.0, max_output_tokens=40, extra_body={"seed": seed})
        jsonschema.validate(json.loads(r.output_text), SCHEMA)
        assert r.text.format.type == "json_schema"
    assert create(client, text={"format": {"type": "json_object"}}, temperature=0.0, max_output_tokens=8).output_text.startswith("{")


def test_background_runs_on_without_its_client_and_can_be_reattached(client, server):
    body = {"input": "Tell me a story.", "background": True, "stream": True, "temperature": 0.0, "max_output_tokens": 40,
            "ignore_eos": True, **NO_THINKING}  # fmt: skip
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json=body, timeout=30) as stream:
        lines = stream.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        assert first["type"] == "response.created" and first["response"]["status"] == "queued"
    final = wait_for(client, first["response"]["id"])  # the client left after one event
    assert final.status == "incomplete" and final.background and final.usage.output_tokens == 40

    replay = checked(client.responses.retrieve(final.id, stream=True))
    assert [e.sequence_number for e in replay] == list(range(len(replay)))
    n = next(e.sequence_number for e in replay if e.type == "response.output_text.delta") + 2
    tail = checked(client.responses.retrieve(final.id, stream=True, starting_after=n))
    assert tail[0].sequence_number == n + 1 and [e.sequence_number for e in tail] == list(range(n + 1, len(replay)))
    assert texts(replay[: n + 1]) + texts(tail) == final.output_text == tail[-1].response.output_text


def test_a_follower_attached_mid_run_gets_the_rest_live(client):
    r = create(client, background=True, temperature=0.0, max_output_tokens=200, extra_body={"ignore_eos": True})
    assert r.status == "queued"
    events = checked(client.responses.retrieve(r.id, stream=True, starting_after=1))
    assert events[0].sequence_number == 2 and events[-1].type == "response.incomplete"
    assert texts(events) == client.responses.retrieve(r.id).output_text


def test_cancel_a_background_response(client):
    r = create(client, background=True, temperature=0.0, max_output_tokens=560, extra_body={"ignore_eos": True})
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < 560
    assert client.responses.retrieve(r.id).status == "cancelled"
    assert client.responses.cancel(r.id).status == "cancelled"  # cancelling again returns it unchanged
    done = create(client, background=True, max_output_tokens=2)
    done = wait_for(client, done.id)
    assert client.responses.cancel(done.id).status == done.status
    with pytest.raises(openai.BadRequestError, match="only background"):
        client.responses.cancel(create(client, max_output_tokens=2).id)


def test_a_foreground_response_whose_client_leaves_is_aborted(client, server):
    body = {"input": "Hi", "max_output_tokens": 560, "ignore_eos": True, **NO_THINKING}
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json={**body, "stream": True}, timeout=30) as stream:
        first = json.loads(next(line for line in stream.iter_lines() if line.startswith("data: "))[6:])
    final = wait_for(client, first["response"]["id"])
    assert final.status == "cancelled" and final.usage.output_tokens < 560

    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up before the body comes
        httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=0.5)
    [response_id] = re.findall(r"(resp_\w+): 1 prompt", server.log())[-1:]
    assert wait_for(client, response_id).status == "cancelled"


def test_delete_and_what_is_not_found(client):
    r = create(client, max_output_tokens=2)
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: create(client, max_output_tokens=2, previous_response_id=r.id)):  # fmt: skip
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["type"] == "not_found_error" and r.id in e.value.body["message"]
    unstored = create(client, max_output_tokens=2, store=False)
    assert unstored.status in ("completed", "incomplete") and unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        create(client, previous_response_id="resp_unknown")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"frobnicate": 1}, "frobnicate"),
        ({"background": True, "store": False}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.message.content"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": []}, "input"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(server, fields, param):
    response = httpx.post(f"{server.base_url}/v1/responses", json={"input": "Hi", **fields}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param), error


def test_sigterm_lets_a_background_response_finish(tiny_model, tmp_path):
    """No client is attached, yet the drain waits for the response (within --shutdown-timeout)."""
    with serve(tiny_model, "--max-model-len", "640", log_dir=tmp_path) as s:
        response = s.client().responses.create(model=None, input="Tell me a story", background=True, max_output_tokens=80,
                                               extra_body={"ignore_eos": True, **NO_THINKING})  # fmt: skip
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=60) == 0
        assert f"{response.id}: incomplete, 80 output tokens" in s.log()  # it ran to max_output_tokens
