"""Batch input lines (OpenAI's JSONL: custom_id, method, url, body) and how one is answered.

A line runs through the same `OpenAIServing` as an HTTP request, without the HTTP: its
answer is the status code and body that request would have got.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from oxserve.server.batch.store import Line
from oxserve.server.protocol import APIError
from oxserve.server.serving import OpenAIServing

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_LINES = 50_000  # as OpenAI's Batch API


def parse_lines(content: bytes, endpoint: str | None) -> tuple[list[Line], list[dict[str, Any]]]:
    """The file's requests, and the errors that make it unusable (OpenAI's error objects, with
    the 1-based line). `endpoint`: every line's url must be it (None: any supported one)."""
    lines: list[Line] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()

    def fail(number: int, code: str, message: str) -> None:
        errors.append({"code": code, "message": message, "param": None, "line": number})

    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        return [], [{"code": "invalid_json_line", "message": "the file is not UTF-8 text", "param": None, "line": None}]
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except ValueError:
            fail(number, "invalid_json_line", "this line is not valid JSON")
            continue
        if not isinstance(item, dict) or not isinstance(item.get("custom_id"), str) or not isinstance(item.get("body"), dict):
            fail(number, "invalid_request", "a line is an object with a string custom_id, method, url and an object body")
            continue
        url = item.get("url")
        if item.get("method") != "POST" or url not in ENDPOINTS or (endpoint is not None and url != endpoint):
            wanted = endpoint or " or ".join(ENDPOINTS)
            fail(number, "invalid_url", f"method must be POST and url {wanted}, got {item.get('method')!r} {url!r}")
            continue
        if item["body"].get("stream"):
            fail(number, "invalid_request", "a batch line cannot stream: drop stream")
            continue
        if item["custom_id"] in seen:
            fail(number, "duplicate_custom_id", f"custom_id {item['custom_id']!r} is used by an earlier line")
            continue
        seen.add(item["custom_id"])
        lines.append(Line(len(lines), item["custom_id"], url, item["body"]))
    if not lines and not errors:
        errors.append({"code": "empty_file", "message": "the file holds no requests", "param": None, "line": None})
    if len(lines) > MAX_LINES:
        errors.append({"code": "too_many_requests", "message": f"a batch holds at most {MAX_LINES} requests", "param": None,
                       "line": None})  # fmt: skip
    return lines, errors


async def answer(serving: OpenAIServing, line: Line, priority: int | None = None) -> tuple[int, dict[str, Any]]:
    """(status code, output line) for one input line. `priority`: the one to run it at when the
    body names none (batch work yields to interactive requests under the priority policy)."""
    body = line.body if priority is None or "priority" in line.body else {**line.body, "priority": priority}
    route = serving.completions if line.url == "/v1/completions" else serving.chat
    try:
        response = await route(json.dumps(body).encode(), None)
        status, payload = response.status_code, json.loads(response.body)
    except APIError as e:
        status, payload = e.status, e.body()
    except Exception:  # an answer for the line whatever failed; the cause goes to the log only
        log.exception("batch line %r failed", line.custom_id)
        status, payload = 500, APIError(500, "internal server error (the server's log has the details)", "server_error").body()
    error = None if status == 200 else {"code": payload.get("error", {}).get("code"), "message": payload.get("error", {}).get("message")}
    return status, {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
                    "response": {"status_code": status, "request_id": payload.get("id"), "body": payload}, "error": error}  # fmt: skip
