"""Lark grammars that force a GLM-format tool call, for `tool_choice: required` or a named
function, so the call the model writes always parses:

    <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>

A tool's arguments follow its parameter schema's properties in order, the required ones
always, the others optionally. A string value is written verbatim (no `<`, so it cannot run
into the closing tag; `maxLength` bounds it); any other value is JSON matching its schema.
"""

from __future__ import annotations

import json
from typing import Any

from oxserve.structured.grammar import lark_literal


def tool_call_grammar(tools: list[dict[str, Any]], parallel: bool) -> str:
    """`tools`: OpenAI `function` objects ({"name", "parameters"}) the call may pick from."""
    rules = [f"start: call{'+' if parallel else ''}", "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        params = tool.get("parameters") or {}
        properties: dict[str, Any] = params.get("properties") or {}
        required = set(params.get("required") or [])
        args = []
        for j, (key, schema) in enumerate(properties.items()):
            rules.append(f"arg_{i}_{j}: " + lark_literal(f"<arg_key>{key}</arg_key><arg_value>") + f" {_value(schema)} "
                         + lark_literal("</arg_value>"))  # fmt: skip
            args.append(f"arg_{i}_{j}" + ("" if key in required else "?"))
        head = lark_literal(f"<tool_call>{tool['name']}")
        rules.append(f"call_{i}: {head} {' '.join(args)} {lark_literal('</tool_call>')}")
    return "\n".join(rules) + "\n"


def _value(schema: Any) -> str:
    if not isinstance(schema, dict):
        return "%json {}"
    if schema.get("type") != "string":
        return f"%json {json.dumps(schema)}"
    options = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    if options is not None:  # verbatim, like any string value
        return "(" + " | ".join(lark_literal(str(o)) for o in options) + ")"
    if "pattern" in schema:
        return "/" + schema["pattern"].replace("/", "\\/") + "/"
    limit = schema.get("maxLength")
    return f"/[^<]{{0,{int(limit)}}}/" if isinstance(limit, int) else "/[^<]*/"
