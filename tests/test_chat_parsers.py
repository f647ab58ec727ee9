"""The GLM reasoning and tool-call parsers: exact reads of whole outputs, malformed ones
included, and the stream invariant: however an output is split into deltas, the merged
delta fragments say what the whole-text parse says."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oxserve.server.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ChatOutputParser,
    GlmReasoningParser,
    ReasoningStream,
    ToolCallStream,
    parse_tool_calls,
    reasoning_ended,
    reasoning_parser,
    tool_parser,
    tool_schema_index,
)


def fn(name: str, **properties: Any) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties}
    return {
        "type": "function",
        "function": {"name": name, "description": "", "parameters": parameters},
    }


TOOLS = [
    fn("get_weather", city={"type": "string"}, days={"type": "integer"}),
    fn(
        "configure",
        on={"type": "boolean"},
        ratio={"type": "number"},
        opts={"type": "object"},
        tags={"type": "array", "items": {"type": "string"}},
        code={"type": "string"},
        nothing={"type": "null"},
        either={"anyOf": [{"type": "integer"}, {"type": "null"}]},
        label={"type": ["string", "null"]},
        mode={"enum": ["fast", "slow"]},
        level={"enum": [1, 2, 3]},
    ),
    fn("ping"),
]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def call(name: str, *args: tuple[str, str], sep: str = "") -> str:
    body = "".join(
        f"{sep}<arg_key>{k}</arg_key>{sep}<arg_value>{v}</arg_value>" for k, v in args
    )
    return f"<tool_call>{name}{body}{sep}</tool_call>"


def calls_of(text: str, tools: list | None = TOOLS) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in parse_tool_calls(text, tools).tool_calls]


# ---- merging a stream's fragments ------------------------------------------------------
def merged(fragments: list[dict[str, Any]]) -> dict[str, Any]:
    """The fields a client rebuilds from a stream, checking each fragment's shape."""
    out: dict[str, Any] = {"reasoning_content": "", "content": "", "calls": []}
    for f in fragments:
        assert len(f) == 1, f
        [(key, value)] = f.items()
        if key in ("content", "reasoning_content"):
            assert isinstance(value, str) and value, f
            out[key] += value
            continue
        assert key == "tool_calls" and len(value) == 1, f
        [piece] = value
        if "id" in piece:  # a call's announcement: once, in index order, its name whole
            assert piece["index"] == len(out["calls"]) and CALL_ID.fullmatch(
                piece["id"]
            )
            assert piece["type"] == "function" and piece["function"]["name"]
            out["calls"].append([piece["function"]["name"], ""])
        else:
            assert set(piece) == {"index", "function"} and set(piece["function"]) == {
                "arguments"
            }
            assert piece["index"] == len(out["calls"]) - 1  # only the latest call grows
        out["calls"][-1][1] += piece["function"]["arguments"]
    out["calls"] = [tuple(c) for c in out["calls"]]
    return out


def pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def streamed(stream: Any, deltas: list[str]) -> dict[str, Any]:
    fragments = [f for d in deltas for f in stream.push(d)]
    return merged(fragments + stream.finish())


# ---- tool calls: exact reads -----------------------------------------------------------
def test_the_documented_example():
    text = (
        "some optional content text"
        + call("get_weather", ("city", "Paris"), ("days", "3"))
        + "<tool_call>other_fn</tool_call>"
    )
    tools = [
        fn("get_weather", city={"type": "string"}, days={"type": "integer"}),
        fn("other_fn"),
    ]
    out = parse_tool_calls(text, tools)
    assert out.content == "some optional content text"
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("get_weather", '{"city": "Paris", "days": 3}'),
        ("other_fn", "{}"),
    ]
    assert all(CALL_ID.fullmatch(c.id) for c in out.tool_calls)
    assert len({c.id for c in out.tool_calls}) == 2
    assert out.problems == []
    assert out.tool_calls[0].openai() == {
        "id": out.tool_calls[0].id,
        "type": "function",
        "function": {
            "name": "get_weather",
            "arguments": '{"city": "Paris", "days": 3}',
        },
    }


def test_glm45_newlines_between_elements():
    text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    out = parse_tool_calls(text, TOOLS)
    assert out.content is None and out.problems == []
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("get_weather", '{"city": "Paris", "days": 3}')
    ]


def test_names_and_keys_are_stripped_string_values_are_verbatim():
    text = call(" get_weather \n", (" city\n", "  New York \n"), ("days", " 2 "))
    assert calls_of(text) == [("get_weather", '{"city": "  New York \\n", "days": 2}')]


def test_parallel_calls():
    text = (
        call("get_weather", ("city", "Oslo"))
        + "\n"
        + call("ping")
        + "\n"
        + call("get_weather", ("days", "1"))
    )
    assert calls_of(text) == [
        ("get_weather", '{"city": "Oslo"}'),
        ("ping", "{}"),
        ("get_weather", '{"days": 1}'),
    ]


def test_arguments_are_typed_by_the_schema():
    args = [
        ("on", "true"),
        ("ratio", "0.25"),
        ("opts", '{"a": 1, "b": [true, null]}'),
        ("tags", '["x", "y"]'),
        ("code", "42"),  # a string that looks like a number stays a string
        ("nothing", "null"),
        ("either", "7"),
        ("label", "12"),  # a union with string: verbatim
        ("mode", "fast"),
        ("level", "2"),
    ]
    out = parse_tool_calls(call("configure", *args), TOOLS)
    assert out.problems == []
    [c] = out.tool_calls
    expected = {"on": True, "ratio": 0.25, "opts": {"a": 1, "b": [True, None]}, "tags": ["x", "y"],
                "code": "42", "nothing": None, "either": 7, "label": "12", "mode": "fast", "level": 2}  # fmt: skip
    assert json.loads(c.arguments) == expected
    # same key order and format
    assert c.arguments == json.dumps(expected, ensure_ascii=False)


def test_python_literals_for_booleans_and_none():
    text = call("configure", ("on", "False"), ("nothing", "None"), ("either", " None "))
    assert calls_of(text) == [
        ("configure", '{"on": false, "nothing": null, "either": null}')
    ]
    # but only where the schema allows them
    out = parse_tool_calls(call("get_weather", ("days", "True")), TOOLS)
    assert [c.arguments for c in out.tool_calls] == ['{"days": "True"}']
    assert len(out.problems) == 1 and "'True' is not JSON (integer)" in out.problems[0]


def test_unknown_tool_and_parameter_values_are_strings():
    out = parse_tool_calls(
        call("lookup", ("n", "3")) + call("get_weather", ("extra", "[1]")), TOOLS
    )
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("lookup", '{"n": "3"}'),
        ("get_weather", '{"extra": "[1]"}'),
    ]
    assert out.problems == [
        "tool call 'lookup': unknown function (known: configure, get_weather, ping)"
    ]


def test_bad_json_for_an_integer_is_kept_as_written():
    out = parse_tool_calls(
        call("get_weather", ("city", "Oslo"), ("days", "soon")), TOOLS
    )
    assert [c.arguments for c in out.tool_calls] == ['{"city": "Oslo", "days": "soon"}']
    assert out.problems == [
        "tool call 'get_weather': argument 'days': 'soon' is not JSON (integer); kept as a string"
    ]
    # not JSON either
    out = parse_tool_calls(call("configure", ("ratio", "NaN")), TOOLS)
    assert [c.arguments for c in out.tool_calls] == ['{"ratio": "NaN"}'] and len(
        out.problems
    ) == 1


def test_unicode_and_escapes():
    text = "Voilà 🌧️ " + call(
        "get_weather", ("city", 'Zürich "北京"\\\n\t'), ("days", "2")
    )
    out = parse_tool_calls(text, TOOLS)
    assert out.content == "Voilà 🌧️"
    [c] = out.tool_calls
    assert c.arguments == '{"city": "Zürich \\"北京\\"\\\\\\n\\t", "days": 2}'
    assert json.loads(c.arguments) == {"city": 'Zürich "北京"\\\n\t', "days": 2}


def test_content_around_the_calls():
    text = (
        "Let me check.\n\n"
        + call("ping")
        + "\nand then some words"
        + call("ping")
        + " more"
    )
    out = parse_tool_calls(text, TOOLS)
    # stripped at its end; after the first call, dropped
    assert out.content == "Let me check."
    assert len(out.tool_calls) == 2
    assert out.problems == ["20 non-space characters after a tool call were dropped"]
    assert parse_tool_calls(" \n" + call("ping"), TOOLS).content is None
    no_call = parse_tool_calls("  just text with a </tool_call> and <arg_key>\n", TOOLS)
    assert (
        no_call.content == "  just text with a </tool_call> and <arg_key>\n"
        and no_call.tool_calls == []
    )
    assert parse_tool_calls("", TOOLS).content is None


def test_unterminated_call_keeps_what_was_complete():
    # cut inside a string value: the call was streamed, the value so far is kept, JSON closed
    out = parse_tool_calls(
        "Hi "
        + "<tool_call>get_weather<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>city</arg_key><arg_value>Par",
        TOOLS,
    )
    assert out.content == "Hi"
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("get_weather", '{"days": 3, "city": "Par"}')
    ]
    assert out.problems == [
        "tool call 'get_weather': <arg_value> of 'city' is not closed",
        "tool call 'get_weather': not closed by </tool_call> (output cut short?)",
    ]
    # cut inside a typed value: that value is dropped
    text = call("get_weather", ("city", "Rome")).removesuffix("</tool_call>")
    out = parse_tool_calls(text + "<arg_key>days</arg_key><arg_value>1", TOOLS)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("get_weather", '{"city": "Rome"}')
    ]
    assert (
        out.problems[0]
        == "tool call 'get_weather': the value of 'days' was cut short; dropped"
    )
    # cut after a key, and before the name was complete
    assert calls_of("<tool_call>ping<arg_key>x</arg_key>") == [("ping", "{}")]
    out = parse_tool_calls("Sure.<tool_call>get_wea", TOOLS)
    assert out.content == "Sure." and out.tool_calls == []
    assert out.problems == [
        "<tool_call>get_wea was cut short before its name was complete; dropped"
    ]
    # the text cut short at a partial tag is no call at all
    assert parse_tool_calls("Sure.<tool_ca", TOOLS).content == "Sure.<tool_ca"


def test_malformed_calls_never_raise():
    text = call("get_weather", ("city", "A")).replace("</arg_value>", "")
    out = parse_tool_calls(text, TOOLS)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("get_weather", '{"city": "A"}')
    ]
    assert out.problems == [
        "tool call 'get_weather': <arg_value> of 'city' is not closed"
    ]
    # a key without its value, a value without its key, stray text, a repeated key
    text = "<tool_call>get_weather<arg_key>days</arg_key><arg_key>city</arg_key>x<arg_value>B</arg_value><arg_value>orphan</arg_value><arg_key>city</arg_key><arg_value>C</arg_value></tool_call>"
    out = parse_tool_calls(text, TOOLS)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("get_weather", '{"city": "B"}')
    ]
    assert out.problems == [
        "tool call 'get_weather': argument 'days' has no <arg_value>; dropped",
        "tool call 'get_weather': stray text between arguments ignored",
        "tool call 'get_weather': <arg_value> without an <arg_key>; ignored",
        "tool call 'get_weather': argument 'city' is repeated; the first value is kept",
    ]
    # a call inside a call, a call without a name, an unclosed key
    out = parse_tool_calls(
        "<tool_call>ping<tool_call></tool_call><tool_call>ping<arg_key>a</tool_call>",
        TOOLS,
    )
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("ping", "{}"),
        ("ping", "{}"),
    ]
    assert out.problems == [
        "tool call 'ping': not closed by </tool_call> (output cut short?)",
        "a <tool_call> without a function name was dropped",
        "tool call 'ping': <arg_key>a is not closed; dropped",
    ]


def test_tool_schema_index():
    assert tool_schema_index(TOOLS[:1]) == {
        "get_weather": {"city": {"type": "string"}, "days": {"type": "integer"}}
    }
    bare = {"name": "f", "parameters": {"properties": {"x": {"type": "number"}}}}
    assert tool_schema_index(
        [bare, {"type": "function", "function": {"name": "g"}}]
    ) == {"f": {"x": {"type": "number"}}, "g": {}}
    assert tool_schema_index(None) == {}


# ---- tool calls: streaming -------------------------------------------------------------
def test_stream_holds_back_a_possible_tag_and_sends_the_name_early():
    s = ToolCallStream(TOOLS)
    assert s.push("Checking <tool_") == [{"content": "Checking"}]
    assert s.push("call>get_wea") == []
    [announce] = s.push("ther<arg_key>ci")
    [piece] = announce["tool_calls"]
    assert (
        piece["function"] == {"name": "get_weather", "arguments": ""}
        and piece["index"] == 0
    )
    assert s.push("ty</arg_key><arg_value>Pa") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]}
    ]
    assert s.push("ris</arg_val") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": "ris"}}]}
    ]
    assert s.push("ue><arg_key>days</arg_key><arg_value>4") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '"'}}]}
    ]
    assert s.push("</arg_value></tool_call>") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ', "days": 4}'}}]}
    ]
    assert s.finish() == []
    s = ToolCallStream(TOOLS)
    assert s.push("no call <tool_") == [{"content": "no call"}]
    assert s.push("box> ") == [{"content": " <tool_box>"}]
    assert s.finish() == [{"content": " "}]


# no "_": no tag by chance
ALPHABET = st.sampled_from(list('ab z09\n\t"\\{}[]<>/é漢🙂.:,'))
TEXT = st.text(ALPHABET, max_size=12)


@st.composite
def typed_arg(draw: st.DrawFn, key: str) -> tuple[str, str, Any]:
    """(key, the text the model writes, the value it must read as)."""
    schema = TOOLS[1]["function"]["parameters"]["properties"].get(
        key, {"type": "string"}
    )
    kind = schema.get("type", "string")
    pad = draw(st.sampled_from(["", " ", "\n"]))
    if kind == "boolean":
        value = draw(st.booleans())
        return (
            key,
            pad + draw(st.sampled_from([json.dumps(value), str(value)])) + pad,
            value,
        )
    if kind in ("number", "integer") or key == "level":
        value = draw(
            st.integers(-5, 10**12) | st.floats(-1e6, 1e6, allow_nan=False)
            if kind == "number"
            else st.integers(1, 3)
        )
        return key, pad + json.dumps(value) + pad, value
    if kind in ("object", "array"):
        leaf = st.none() | st.booleans() | st.integers() | TEXT
        value = draw(
            st.dictionaries(TEXT, leaf, max_size=3)
            if kind == "object"
            else st.lists(leaf, max_size=3)
        )
        return (
            key,
            pad + json.dumps(value, ensure_ascii=draw(st.booleans())) + pad,
            value,
        )
    # strings, those that look like JSON too
    value = draw(st.text(ALPHABET, max_size=16))
    return key, value, value


@st.composite
def tool_output(draw: st.DrawFn) -> tuple[str, str | None, list[tuple[str, str]]]:
    """A model's output, the content it must read as, and its calls."""
    content = draw(TEXT)
    calls: list[tuple[str, str]] = []
    text = content
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(["get_weather", "configure", "ping"]))
        keys = {"get_weather": ["city", "days"], "ping": ["any"], "configure": ["on", "ratio", "opts", "tags", "code", "label", "mode", "level"]}[name]  # fmt: skip
        chosen = draw(st.lists(st.sampled_from(keys), unique=True, max_size=4))
        args = [
            draw(typed_arg(k)) if name == "configure" else _plain_arg(draw, name, k)
            for k in chosen
        ]
        sep = draw(st.sampled_from(["", "\n"]))
        text += call(
            draw(st.sampled_from([name, f"{name}\n", f" {name}"])),
            *[(k, t) for k, t, _ in args],
            sep=sep,
        )
        text += draw(st.sampled_from(["", "\n", " \n "]))
        calls.append((name, json.dumps({k: v for k, _, v in args}, ensure_ascii=False)))
    expected = (content.rstrip() if calls else content) or None
    return text, expected, calls


def _plain_arg(draw: st.DrawFn, name: str, key: str) -> tuple[str, str, Any]:
    if key == "days":
        value = draw(st.integers(0, 30))
        return key, json.dumps(value), value
    value = draw(TEXT)
    return key, value, value


@settings(max_examples=300, deadline=None)
@given(tool_output(), st.data())
def test_tool_stream_split_invariance(case, data):
    text, content, calls = case
    out = parse_tool_calls(text, TOOLS)
    assert out.content == content
    assert [(c.name, c.arguments) for c in out.tool_calls] == calls
    assert out.problems == []
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    got = streamed(ToolCallStream(TOOLS), pieces(text, cuts))
    assert got["content"] == (content or "") and got["calls"] == calls


SOUP = st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                                 "</arg_value>", "<tool_", "</arg", "get_weather", "configure", "days", "on",
                                 "city", "3", "true", "x", " ", "\n", "{", '"']), max_size=25).map("".join)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(SOUP, st.data())
def test_malformed_outputs_stream_as_they_parse(text, data):
    out = parse_tool_calls(text, TOOLS)  # never raises
    for c in out.tool_calls:
        assert isinstance(json.loads(c.arguments), dict)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    stream = ToolCallStream(TOOLS)
    got = streamed(stream, pieces(text, cuts))
    assert got["content"] == (out.content or "")
    assert got["calls"] == [(c.name, c.arguments) for c in out.tool_calls]
    assert stream.problems == out.problems


# ---- reasoning -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "starts,text,expected",
    [
        (
            True,
            "I should look.\n</think>\n\nParis is sunny.",
            ("I should look.\n", "Paris is sunny."),
        ),
        (
            True,
            "still thinking <b>",
            ("still thinking <b>", None),
        ),  # never closed: all reasoning
        (True, "</think>\n", ("", None)),
        (True, "a</think>b</think>\n<think>c", ("a", "b</think>\n<think>c")),
        (True, "", ("", None)),
        (
            False,
            "\n <think>hmm</think>\nok",
            ("hmm", "ok"),
        ),  # older models open the block
        (False, "<think>hmm", ("hmm", None)),
        (False, "plain answer </think>", (None, "plain answer </think>")),
        (False, " x<think>y</think>", (None, " x<think>y</think>")),
        (False, "  <thi", (None, "  <thi")),
        (False, "", (None, None)),
    ],
)
def test_reasoning_split(starts, text, expected):
    assert GlmReasoningParser(starts).split(text) == expected
    got = streamed(ReasoningStream(starts), list(text))  # one character at a time
    assert (got["reasoning_content"], got["content"]) == tuple(
        x or "" for x in expected
    )


def test_reasoning_stream_never_sends_a_tag_into_the_wrong_field():
    s = ReasoningStream(True)
    assert s.push("Let me think </thi") == [{"reasoning_content": "Let me think "}]
    assert s.push("nk>\n") == []
    assert s.push("\nAnswer") == [{"content": "Answer"}]
    assert s.push(" </think>") == [{"content": " </think>"}]
    s = ReasoningStream(False)
    assert s.push(" <thi") == []
    assert s.push("nk>ok </th") == [{"reasoning_content": "ok "}]
    assert s.finish() == [{"reasoning_content": "</th"}]


def test_reasoning_ended():
    assert not reasoning_ended("still <think>ing </thi")
    assert reasoning_ended("done</think>")


REASONING_TEXT = st.text(st.sampled_from(list("ab \n<>/thinké🙂")), max_size=20)


@settings(max_examples=300, deadline=None)
@given(st.booleans(), REASONING_TEXT, st.data())
def test_reasoning_stream_split_invariance(starts, text, data):
    text = data.draw(
        st.sampled_from([text, "<think>" + text, " \n<think>" + text + "</think>\n\nx"])
    )
    reasoning, content = GlmReasoningParser(starts).split(text)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    got = streamed(ReasoningStream(starts), pieces(text, cuts))
    assert got["reasoning_content"] == (reasoning or "") and got["content"] == (
        content or ""
    )


# ---- both, composed --------------------------------------------------------------------
def test_chat_output_parser_whole():
    text = (
        "Weather? "
        + call("ping")
        + "</think>\n\nLooking.\n"
        + call("get_weather", ("city", "Rome"))
    )
    out = ChatOutputParser(reasoning=True, starts_in_reasoning=True, tools=TOOLS).parse(
        text
    )
    # a call while thinking is thinking
    assert out.reasoning_content == "Weather? " + call("ping")
    assert out.content == "Looking."
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("get_weather", '{"city": "Rome"}')
    ]
    assert out.problems == []
    plain = ChatOutputParser(
        reasoning=False, starts_in_reasoning=True, tools=None
    ).parse("<think>a</think>" + call("ping"))
    assert (plain.reasoning_content, plain.content, plain.tool_calls) == (
        None,
        "<think>a</think>" + call("ping"),
        [],
    )


def test_chat_output_parser_stream_keeps_output_order():
    p = ChatOutputParser(reasoning=True, starts_in_reasoning=True, tools=TOOLS)
    fragments = p.push("hm</think>\nSure<tool_call>ping</tool_call>")
    assert fragments[:2] == [{"reasoning_content": "hm"}, {"content": "Sure"}]
    [[announce]] = [f["tool_calls"] for f in fragments[2:]]
    assert announce["function"] == {"name": "ping", "arguments": "{}"}
    assert p.finish() == [] and p.problems == []


@settings(max_examples=200, deadline=None)
@given(st.booleans(), st.booleans(), REASONING_TEXT, tool_output(), st.data())
def test_chat_output_parser_split_invariance(reasoning, starts, thought, case, data):
    text = (
        data.draw(
            st.sampled_from(
                [thought + "</think>\n", "", "<think>" + thought + "</think>"]
            )
        )
        + case[0]
    )
    tools = data.draw(st.sampled_from([TOOLS, None]))
    parser = ChatOutputParser(
        reasoning=reasoning, starts_in_reasoning=starts, tools=tools
    )
    out = parser.parse(text)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    got = streamed(
        ChatOutputParser(reasoning=reasoning, starts_in_reasoning=starts, tools=tools),
        pieces(text, cuts),
    )
    assert got["reasoning_content"] == (out.reasoning_content or "")
    assert got["content"] == (out.content or "")
    assert got["calls"] == [(c.name, c.arguments) for c in out.tool_calls]


def test_registries():
    assert sorted(TOOL_PARSERS) == ["glm"] and sorted(REASONING_PARSERS) == ["glm"]
    assert (
        tool_parser("glm") is TOOL_PARSERS["glm"]
        and reasoning_parser("glm") is REASONING_PARSERS["glm"]
    )
    with pytest.raises(
        ValueError, match=r"unknown tool-call parser 'hermes'; known: glm"
    ):
        tool_parser("hermes")
    with pytest.raises(
        ValueError, match=r"unknown reasoning parser 'deepseek_r1'; known: glm"
    ):
        ChatOutputParser(
            reasoning=True,
            starts_in_reasoning=False,
            tools=None,
            reasoning_parser_name="deepseek_r1",
        )
