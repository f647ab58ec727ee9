"""Lark grammars that force a GLM-format tool call, for `tool_choice: required` or a named
function, so the call the model writes always parses:

    <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>

A tool's arguments follow its parameter schema's properties in order, the required ones
always, the others optionally; a schema without properties (but not closed to others by
`additionalProperties: false`) takes any keys. Each value is written the way the tool-call
parser reads it back (`parsers.glm_tools.schema_types` decides both): verbatim text for a
parameter that admits strings or does not say (no `<`, so it cannot run into the closing
tag; `maxLength`/`minLength` bound it, `enum`/`const` list it, `pattern` shapes it), JSON
matching the schema for any other, with the root's `$defs` so its `$ref`s resolve.
"""

from __future__ import annotations

import json
from typing import Any

from oxserve.server.parsers.glm_tools import resolved, schema_types
from oxserve.structured.grammar import lark_literal

ANY_TEXT = "/[^<]*/"


def tool_call_grammar(tools: list[dict[str, Any]], parallel: bool) -> str:
    """`tools`: OpenAI `function` objects ({"name", "parameters"}) the call may pick from.
    ValueError when a tool's parameters are not a JSON schema of an object."""
    rules = [f"start: call{'+' if parallel else ''}", "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        params = _object_schema(tool)
        properties, required = params.get("properties") or {}, set(params.get("required") or [])
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
        args = []
        for j, (key, schema) in enumerate(properties.items()):
            rules.append(f"arg_{i}_{j}: {_pair(lark_literal(key), _value(resolved(schema, params), defs))}")
            args.append(f"arg_{i}_{j}" + ("" if key in required else "?"))
        if not properties and params.get("additionalProperties") is not False:
            rules.append(f"arg_{i}_any: {_pair('/[^<]+/', ANY_TEXT)}")
            args.append(f"arg_{i}_any*")
        head = lark_literal(f"<tool_call>{tool['name']}")
        rules.append(f"call_{i}: {head} {' '.join(args)} {lark_literal('</tool_call>')}")
    return "\n".join(rules) + "\n"


def _object_schema(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool.get("parameters") or {}
    name = tool.get("name")
    if not isinstance(params, dict):
        raise ValueError(f"tool {name!r}: parameters must be a JSON schema object")
    if not isinstance(params.get("properties") or {}, dict):
        raise ValueError(f"tool {name!r}: parameters.properties must be an object of schemas")
    required = params.get("required") or []
    if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
        raise ValueError(f"tool {name!r}: parameters.required must be a list of names")
    return params


def _pair(key: str, value: str) -> str:
    return f'"<arg_key>" {key} "</arg_key>" "<arg_value>" {value} "</arg_value>"'


def _value(schema: Any, defs: dict[str, Any]) -> str:
    types = schema_types(schema)
    if schema is False:
        raise ValueError("a parameter's schema is false: no value could match it")
    if types and "string" not in types:
        return f"%json {json.dumps({**schema, **defs})}"
    if not isinstance(schema, dict):
        return ANY_TEXT
    options = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else None
    if options:  # as the parser reads them back: strings verbatim, other values as their JSON text
        return "(" + " | ".join(lark_literal(o if isinstance(o, str) else json.dumps(o)) for o in options) + ")"
    if isinstance(schema.get("pattern"), str):
        return "/" + _slashes_escaped(schema["pattern"]) + "/"
    low, high = (schema.get(k) for k in ("minLength", "maxLength"))
    low = low if isinstance(low, int) and not isinstance(low, bool) and low > 0 else 0
    high = high if isinstance(high, int) and not isinstance(high, bool) and high >= low else None
    return ANY_TEXT if low == 0 and high is None else f"/[^<]{{{low},{'' if high is None else high}}}/"


def _slashes_escaped(pattern: str) -> str:
    """`pattern` inside Lark's /.../: an unescaped `/` gets a backslash, escapes stay as they are."""
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] == "\\" and i + 1 < len(pattern):
            out.append(pattern[i : i + 2])
            i += 2
            continue
        out.append("\\/" if pattern[i] == "/" else pattern[i])
        i += 1
    return "".join(out)
