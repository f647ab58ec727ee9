"""The forced-call grammar writes exactly what the tool-call parser reads back, with the types
the schema gives: the two agree on which values are verbatim text and which are JSON."""

from __future__ import annotations

import json

import pytest

from oxserve.server.parsers import parse_tool_calls
from oxserve.server.tool_grammar import tool_call_grammar
from oxserve.structured import StructuredOutputs
from oxserve.structured.grammar import GrammarCompiler
from oxserve.tokenizer import Tokenizer

OBJ = {"type": "object"}
CASES = [
    # untyped, enum without type, string-or-null: verbatim text, as the parser reads them
    ({**OBJ, "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": ["string", "null"]}, "c": {"description": "d"}},
      "required": ["a", "b", "c"]},
     ("<arg_key>a</arg_key><arg_value>x</arg_value><arg_key>b</arg_key><arg_value>hi</arg_value>"
      "<arg_key>c</arg_key><arg_value>z</arg_value>"), {"a": "x", "b": "hi", "c": "z"}),
    # a Pydantic-style nested model: the $ref is followed, the value is JSON
    ({**OBJ, "$defs": {"P": {**OBJ, "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
      "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"]},
     '<arg_key>p</arg_key><arg_value>{"x":3}</arg_value>', {"p": {"x": 3}}),
    # no properties, open to any: any keys, string values
    ({**OBJ, "additionalProperties": {"type": "string"}},
     "<arg_key>k1</arg_key><arg_value>v1</arg_value><arg_key>k2</arg_key><arg_value>v2</arg_value>", {"k1": "v1", "k2": "v2"}),
    # a pattern with an escaped and an unescaped slash; an integer enum as JSON
    ({**OBJ, "properties": {"path": {"type": "string", "pattern": "a\\/b/c"}, "n": {"type": "integer", "enum": [1, 2]}},
      "required": ["path", "n"]},
     "<arg_key>path</arg_key><arg_value>a/b/c</arg_value><arg_key>n</arg_key><arg_value>2</arg_value>", {"path": "a/b/c", "n": 2}),
]  # fmt: skip


@pytest.fixture(scope="module")
def compiler(tiny_model_dir) -> GrammarCompiler:
    return GrammarCompiler((tiny_model_dir / "tokenizer.json").read_text(), 8192, 1)


@pytest.mark.parametrize("params,args_text,expected", CASES, ids=["untyped", "ref", "open", "pattern"])
def test_the_grammar_writes_what_the_parser_reads(compiler, tiny_model_dir, params, args_text, expected):
    tool = {"name": "f", "parameters": params}
    matcher = compiler.matcher(StructuredOutputs(grammar=tool_call_grammar([tool], parallel=False)))
    text = f"<tool_call>f{args_text}</tool_call>"
    assert matcher.consume_tokens(Tokenizer.from_dir(tiny_model_dir).encode(text)) and matcher.is_accepting()
    [call] = parse_tool_calls(text, [tool]).tool_calls
    assert json.loads(call.arguments) == expected


def test_a_quoted_value_is_not_what_an_untyped_parameter_takes(compiler, tiny_model_dir):
    """The defect this pins: `%json` for untyped parameters made the model quote them and the
    client got '"x"'; verbatim text has no quotes to add."""
    tool = {"name": "f", "parameters": CASES[0][0]}
    matcher = compiler.matcher(StructuredOutputs(grammar=tool_call_grammar([tool], parallel=False)))
    prefix = '<tool_call>f<arg_key>a</arg_key><arg_value>"'
    assert not matcher.consume_tokens(Tokenizer.from_dir(tiny_model_dir).encode(prefix))


@pytest.mark.parametrize("params,needle", [({"properties": ["a"]}, "properties"), ({"required": 5}, "required"),
                                           ({"properties": {"a": False}}, "false"), ([1], "JSON schema object")])  # fmt: skip
def test_malformed_parameters_are_value_errors(params, needle):
    with pytest.raises(ValueError, match=needle):
        tool_call_grammar([{"name": "f", "parameters": params}], parallel=False)
