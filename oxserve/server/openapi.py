"""The API's schema: request bodies and error bodies declared from the models that parse them.

Routes read raw bodies and parse them with their own strict models (their 400s are OpenAI's
shape, not FastAPI's 422s), so FastAPI cannot see the bodies. Each route declares its body
here instead (`body`), from the very model that parses it, and every route declares OpenAI's
error body for 4xx and 5xx (`install`): `/openapi.json` is the API, for `/docs` and fuzzers.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorBody(BaseModel):
    """OpenAI's error shape: every 4xx and 5xx answer of this server."""

    error: ErrorDetail


ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {"description": "A client error (OpenAI's error shape)", "content": {"application/json": {"schema": {"$ref": REF.format(model="ErrorBody")}}}},
    "5XX": {"description": "A server error (OpenAI's error shape)", "content": {"application/json": {"schema": {"$ref": REF.format(model="ErrorBody")}}}},
}  # fmt: skip
# One server-sent event: its `data` is a JSON chunk, or [DONE] at the end.
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
_MODEL = "x-oxserve-model"  # the parsing model, carried on the route until `install` takes it off


def body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body `model` parses."""
    return {_MODEL: model, "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}}  # fmt: skip


def answers(model: type[BaseModel] | None, streams: bool = False) -> dict[int | str, dict[str, Any]]:
    """`responses` for a route whose 200 is `model` (None: a JSON object) and, with `streams`,
    server-sent events when the request says `"stream": true`."""
    answer: dict[str, Any] = {"description": "The answer"}
    if model is not None:
        answer["model"] = model
    else:
        answer["content"] = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        answer["description"] = "The answer; server-sent events with stream: true"
        answer.setdefault("content", {})["text/event-stream"] = {"schema": SSE_EVENT}
    return {200: answer}


# Success bodies, for the schema only (the routes build their answers as plain dicts). Fields
# beyond these may be present (vLLM's extras, prompt_logprobs, reasoning_content, ...).
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


def multipart(fields: dict[str, dict[str, Any]], required: list[str]) -> dict[str, Any]:
    """`openapi_extra` for a multipart/form-data upload."""
    schema = {"type": "object", "properties": fields, "required": required}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}


def install(app: FastAPI) -> None:
    """Serve the schema with the declared models, and the error body on every operation; call
    once every route is added."""
    models: list[type[BaseModel]] = [ErrorBody]
    for route in app.routes:
        if (extra := getattr(route, "openapi_extra", None)) and _MODEL in extra:
            models.append(extra.pop(_MODEL))

    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = spec.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                declared = model.model_json_schema(ref_template=REF)
                components.update(declared.pop("$defs", {}))
                components[model.__name__] = declared
            for path in spec["paths"].values():
                for operation in path.values():
                    operation.setdefault("responses", {}).update(ERRORS)
                    operation["responses"].pop("422", None)  # FastAPI's, never sent: bodies are parsed by the routes
            for unused in ("HTTPValidationError", "ValidationError"):  # only the 422s referred to them
                components.pop(unused, None)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = schema  # type: ignore[method-assign]
