"""The agent-facing chat API through the official `openai` client: tool calls (forced,
parallel, streamed), tool results in the conversation, reasoning content and the thinking
switch, structured outputs (JSON schema, JSON object, vLLM's guided_* extras), the errors
each of them gives for bad input; and openai-agents, a real agent framework, using it."""

from __future__ import annotations

import json
import re
from typing import Annotated

import jsonschema
import openai
import pytest
from pydantic import Field
from server_harness import AGENT_ARGS, serve, tiny_model  # noqa: F401  (tiny_model: a fixture)

from oxserve.tokenizer import Tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "days"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 10}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def agent_server(tiny_model, tmp_path_factory):
    with serve(tiny_model, *AGENT_ARGS, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.fixture(scope="module")
def client(agent_server):
    return agent_server.client()


def chat(client, messages=ASK, stream=False, **kw):
    extra = {**NO_THINKING, **kw.pop("extra_body", {})}
    return client.chat.completions.create(model=None, messages=messages, stream=stream, extra_body=extra, **kw)


def merged_stream(chunks) -> dict:
    """A chat stream folded back into one message, as an SDK user would assemble it."""
    message = {"content": "", "reasoning_content": "", "tool_calls": {}, "finish_reason": None}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            message["content"] += delta.content or ""
            message["reasoning_content"] += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                slot = message["tool_calls"].setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = call.id or slot["id"]
                slot["name"] += (call.function.name or "") if call.function else ""
                slot["arguments"] += (call.function.arguments or "") if call.function else ""
            message["finish_reason"] = choice.finish_reason or message["finish_reason"]
    return message


def test_named_tool_choice_forces_a_typed_call_and_its_stream_agrees(client):
    forced = {"type": "function", "function": {"name": "get_weather"}}
    for seed in (1, 2, 3):
        kw = {"tools": [WEATHER, CLOCK], "tool_choice": forced, "parallel_tool_calls": False, "temperature": 1.0, "seed": seed,
              "max_tokens": 60}  # fmt: skip
        full = chat(client, **kw)
        choice = full.choices[0]
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, WEATHER["function"]["parameters"])
        assert isinstance(args["days"], int)  # typed by the schema, not the string "3"

        streamed = merged_stream(chat(client, stream=True, **kw))
        assert streamed["finish_reason"] == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"].values()] == [("get_weather", call.function.arguments)]


def test_required_tool_choice_and_parallel_calls(client):
    names = {"get_weather", "clock"}
    single = chat(client, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=5,
                  max_tokens=60)  # fmt: skip
    assert len(single.choices[0].message.tool_calls) == 1
    assert single.choices[0].message.tool_calls[0].function.name in names
    counts = set()
    for seed in range(6):
        out = chat(client, tools=[WEATHER, CLOCK], tool_choice="required", temperature=1.0, seed=seed, max_tokens=120)
        calls = out.choices[0].message.tool_calls or []
        assert calls and {c.function.name for c in calls} <= names, out.choices[0]
        assert len({c.id for c in calls}) == len(calls)
        counts.add(len(calls))
    assert max(counts) >= 1


def test_tool_results_are_rendered_into_the_prompt(client, tiny_model):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]  # fmt: skip
    out = chat(client, messages=turn, tools=[WEATHER], max_tokens=4, temperature=0.0)
    rendered = Tokenizer.from_dir(tiny_model).apply_chat_template(
        [ASK[0], {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}],
        tools=[WEATHER], enable_thinking=False,
    )  # fmt: skip
    assert "<|observation|><tool_response>sunny, 21 C</tool_response>" in rendered
    assert out.usage.prompt_tokens == len(Tokenizer.from_dir(tiny_model).encode(rendered))


def test_reasoning_is_separated_and_thinking_can_be_switched_off(client, tiny_model):
    tokenizer = Tokenizer.from_dir(tiny_model)
    greedy = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    for thinking in (True, False):
        kwargs = {"enable_thinking": thinking}
        prompt = tokenizer.apply_chat_template(ASK, **kwargs)
        raw = client.completions.create(model=None, prompt=prompt, **greedy).choices[0].text
        reasoning, _, content = raw.partition("</think>")
        extra = {"chat_template_kwargs": kwargs, "ignore_eos": True}
        message = chat(client, temperature=0.0, max_tokens=12, extra_body=extra).choices[0].message
        streamed = merged_stream(chat(client, stream=True, temperature=0.0, max_tokens=12, extra_body=extra))
        if thinking:
            assert message.reasoning_content == reasoning and streamed["reasoning_content"] == reasoning
            assert (message.content or "") == content.lstrip("\n") == streamed["content"]
        else:
            assert message.reasoning_content is None and streamed["reasoning_content"] == ""
            assert message.content == raw == streamed["content"]


def test_json_schema_outputs_validate_streamed_or_not(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        kw = {"response_format": response_format, "temperature": 1.0, "seed": seed, "max_tokens": 40}
        text = chat(client, **kw).choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)
        assert merged_stream(chat(client, stream=True, **kw))["content"] == text
    obj = chat(client, response_format={"type": "json_object"}, temperature=0.0, max_tokens=8).choices[0].message.content
    assert obj.startswith("{")


def test_vllm_guided_extras(client):
    text = chat(client, temperature=1.0, seed=3, max_tokens=20, extra_body={"guided_regex": r"[a-z]{3}-[0-9]{2}"}).choices[0].message.content
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", text)
    text = chat(client, temperature=1.0, seed=4, max_tokens=20, extra_body={"guided_choice": ["left", "right"]}).choices[0].message.content
    assert text in ("left", "right")
    text = chat(client, temperature=1.0, seed=5, max_tokens=30, extra_body={"guided_json": SCHEMA}).choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    text = client.completions.create(model=None, prompt="Pick:", max_tokens=20, temperature=1.0, seed=6,
                                     extra_body={"structured_outputs": {"choice": ["up", "down"]}}).choices[0].text  # fmt: skip
    assert text in ("up", "down")


def test_malformed_tool_arguments_from_the_model_are_reported_not_a_500(client):
    """A call whose integer argument is not JSON (forced here through a regex, as a weak
    model might write it) still answers: the call is read with the value kept as written."""
    bad = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key><arg_value>soon</arg_value></tool_call>"
    out = chat(client, tools=[WEATHER], temperature=0.0, max_tokens=80, extra_body={"guided_regex": re.escape(bad)})
    assert out.choices[0].finish_reason in ("tool_calls", "stop")
    message = out.choices[0].message
    seen = (message.content or "") + "".join(c.function.arguments + c.function.name for c in message.tool_calls or [])
    assert "soon" in seen


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}}, "strnig"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "yaml"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}}, "one output constraint"),
        ({"extra_body": {"guided_regex": "[a-"}}, "regex"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": ["a"]}}}], "tool_choice": "required"},
         "cannot force a call"),
    ],
)
def test_bad_agent_requests_are_400s(client, kwargs, needle):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, max_tokens=4, **kwargs)
    assert needle in err.value.message
    assert chat(client, max_tokens=2).choices[0].message  # and the server goes on


def test_tools_need_the_parser_flags(tiny_model, tmp_path_factory):
    with serve(tiny_model, "--max-model-len", "640", log_dir=tmp_path_factory.mktemp("logs")) as plain:
        with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
            plain.client().chat.completions.create(model=None, messages=ASK, tools=[WEATHER], max_tokens=4)
        # tool_choice "none" keeps the tools in the prompt and reads the output as text
        out = plain.client().chat.completions.create(model=None, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=4)
        assert out.choices[0].message.tool_calls is None


def test_openai_agents_completes_a_tool_using_turn(agent_server):
    """openai-agents (a real agent framework) against the server: the forced call parses, the
    framework runs the tool with typed arguments, sends its result back, and the model answers."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls = []

    @function_tool  # bounded arguments: a random model would otherwise write past max_tokens
    def get_weather(city: Annotated[str, Field(max_length=8)], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """Weather forecast for a city."""
        calls.append((city, days))
        return f"sunny for {days} days in {city}"

    client = agent_server.async_client()
    model = OpenAIChatCompletionsModel(model=agent_server.client().models.list().data[0].id, openai_client=client)
    # Forced on the first turn only (the framework resets tool_choice after a call); greedy,
    # so the second turn's plain answer is reproducible.
    settings = ModelSettings(tool_choice="get_weather", parallel_tool_calls=False, temperature=0.0, max_tokens=32,
                             extra_body=NO_THINKING)  # fmt: skip
    agent = Agent(name="forecaster", instructions="Answer with the forecast.", tools=[get_weather], model=model,
                  model_settings=settings)  # fmt: skip
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)

    assert len(calls) == 1 and isinstance(calls[0][0], str) and isinstance(calls[0][1], int)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, str)
    assert len(result.raw_responses) == 2 and result.raw_responses[1].usage.input_tokens > result.raw_responses[0].usage.input_tokens


def test_openai_agents_on_the_responses_api(agent_server):
    """The framework's default model speaks the Responses API (streamed): the forced call
    parses and runs; the turn stops at the tool's result (a random model's free second turn
    would run to max_output_tokens, which this model reports as an error)."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=8)], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """Weather forecast for a city."""
        calls.append((city, days))
        return f"sunny for {days} days in {city}"

    model = OpenAIResponsesModel(model=agent_server.client().models.list().data[0].id, openai_client=agent_server.async_client())
    settings = ModelSettings(tool_choice="get_weather", parallel_tool_calls=False, temperature=0.0, max_tokens=32,
                             extra_body=NO_THINKING)  # fmt: skip
    agent = Agent(name="forecaster", instructions="Answer with the forecast.", tools=[get_weather], model=model,
                  model_settings=settings, tool_use_behavior="stop_on_first_tool")  # fmt: skip
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)

    assert len(calls) == 1 and isinstance(calls[0][1], int) and 1 <= calls[0][1] <= 7
    assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item"]
    assert result.final_output == f"sunny for {calls[0][1]} days in {calls[0][0]}"
