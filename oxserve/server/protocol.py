"""Request bodies of the OpenAI API (plus vLLM's sampling extras) and their errors.

Bodies are validated strictly from JSON: a string where a number belongs is a 400, not a
silent coercion. Ranges are checked once, by `SamplingParams`, so the server and the
offline API reject the same values with the same messages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError
from starlette.requests import ClientDisconnect, Request

from oxserve.sampling_params import SamplingParams
from oxserve.structured import StructuredOutputs

MAX_BODY_BYTES = 32 * 2**20
MAX_N = 128  # choices per prompt; a guard against one request filling the whole queue
# Every stop string is looked for in every choice's new text at every step: bounded, so that
# one request cannot make each step slow (OpenAI takes 4 strings; vLLM no bound).
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 1024
MAX_STOP_TOKEN_IDS = 1024
StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_LENGTH)]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # as vLLM; seed + choice index stays in torch's range


class APIError(Exception):
    """An error with its HTTP status, rendered as OpenAI's `{"error": {...}}`."""

    def __init__(self, status: int, message: str, type: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}  # sent with the error (a 429's own Retry-After among them)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


async def read_body(request: Request) -> bytes:
    """The whole body, or a 413 as soon as it passes MAX_BODY_BYTES (nothing more is read)."""
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise APIError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes", "invalid_request_error", None,
                               "request_too_large")  # fmt: skip
    except ClientDisconnect:  # gone mid-body (or cut off by the body deadline): nobody reads the answer
        raise APIError(400, "the client left before sending the whole body", "invalid_request_error") from None
    return bytes(body)


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """A 400 naming up to three problems. A query or path parameter (FastAPI's error) is named
    without its location ("limit", not "query.limit")."""
    errors = e.errors(include_url=False) if isinstance(e, ValidationError) else list(e.errors())
    if errors and errors[0]["type"] == "json_invalid":
        return bad_request(f"the body is not valid JSON: {errors[0]['msg']}")
    locs = [err["loc"][1:] if isinstance(e, RequestValidationError) else err["loc"] for err in errors]
    parts = [f"{'.'.join(map(str, loc)) or 'body'}: {err['msg']}" for loc, err in zip(locs, errors[:3])]
    param = ".".join(map(str, locs[0])) if locs and locs[0] else None
    return bad_request("; ".join(parts), param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


# What SamplingParams and the routes accept, stated in the API schema only: the checks stay
# where they are, with their own messages. By field, then by JSON type (the branch of a union).
DOCUMENTED_BOUNDS: dict[str, dict[str, dict[str, Any]]] = {
    "temperature": {"number": {"minimum": 0}},
    "top_p": {"number": {"exclusiveMinimum": 0, "maximum": 1}},
    "min_p": {"number": {"minimum": 0, "maximum": 1}},
    "top_k": {"integer": {"minimum": -1}},
    "presence_penalty": {"number": {"minimum": -2, "maximum": 2}},
    "frequency_penalty": {"number": {"minimum": -2, "maximum": 2}},
    "repetition_penalty": {"number": {"exclusiveMinimum": 0}},
    "max_tokens": {"integer": {"minimum": 0}},
    "max_completion_tokens": {"integer": {"minimum": 1}},
    "logprobs": {"integer": {"minimum": 0, "maximum": 20}},
    "top_logprobs": {"integer": {"minimum": 0, "maximum": 20}},
    "prompt_logprobs": {"integer": {"minimum": 0, "maximum": 20}},
    "prompt": {"string": {"minLength": 1}, "array": {"minItems": 1}},
    "stop": {"string": {"minLength": 1}},
    "stop_token_ids": {"array": {"items": {"type": "integer", "minimum": 0}}},
}


def _document_bounds(schema: dict[str, Any]) -> None:
    for name, bounds in DOCUMENTED_BOUNDS.items():
        field = schema.get("properties", {}).get(name)
        for branch in [] if field is None else field.get("anyOf", [field]):
            branch.update(bounds.get(branch.get("type"), {}))


class _SamplingRequest(BaseModel):
    """Fields both endpoints share; unknown fields (e.g. `user`) are ignored, as OpenAI does."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, json_schema_extra=_document_bounds)

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's field for disaggregated prefill/decode, set by oxserve's router (docs/disaggregation.md):
    # {"export_to": "host:port", "transfer_id": id} on a prefill instance, {"import": id} on a decode one
    kv_transfer_params: dict[str, str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)  # --scheduling-policy priority: lower runs first
    # Structured outputs: OpenAI's response_format, vLLM's guided_* extras and their newer
    # `structured_outputs` object; at most one of them.
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def constraint(self) -> StructuredOutputs | None:
        """The one output constraint the request sets, if any (400 if it sets several)."""
        found = [(name, c) for name, c in self._constraints() if c is not None]
        if len(found) > 1:
            raise bad_request(f"set one output constraint, not {' and '.join(n for n, _ in found)}", found[1][0])
        return found[0][1] if found else None

    def _constraints(self):
        yield "response_format", response_format_constraint(self.response_format)
        schema = self.guided_json
        yield "guided_json", None if schema is None else StructuredOutputs(json=schema if isinstance(schema, str) else _dumps(schema))
        yield "guided_regex", None if self.guided_regex is None else StructuredOutputs(regex=self.guided_regex)
        yield "guided_grammar", None if self.guided_grammar is None else StructuredOutputs(grammar=self.guided_grammar)
        if self.guided_choice is not None:
            yield "guided_choice", _structured(param="guided_choice", choice=tuple(self.guided_choice))
        if self.structured_outputs is not None:
            yield "structured_outputs", structured_outputs_constraint(self.structured_outputs)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        try:
            return SamplingParams(
                n=self.n,
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_k=self.top_k or 0,
                top_p=self.top_p,
                min_p=self.min_p,
                seed=self.seed,
                repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                stop=self.stop or [],
                stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                structured_outputs=self.constraint(),
            )
        except ValueError as e:
            raise bad_request(str(e)) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def response_format_constraint(response_format: dict[str, Any] | None) -> StructuredOutputs | None:
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")  # type: ignore[union-attr]
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise bad_request("response_format json_schema needs json_schema.schema, a JSON schema", "response_format")
        return StructuredOutputs(json=_dumps(schema))
    raise bad_request(f"response_format type {kind!r} is not one of text, json_object, json_schema", "response_format")


def structured_outputs_constraint(spec: dict[str, Any]) -> StructuredOutputs:
    """vLLM's `structured_outputs` object: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}."""
    known = {"json", "regex", "choice", "grammar", "json_object"}
    if unknown := set(spec) - known:
        raise bad_request(f"structured_outputs takes {sorted(known)}, not {sorted(unknown)}", "structured_outputs")
    fields = dict(spec)
    if "json" in fields and not isinstance(fields["json"], str):
        fields["json"] = _dumps(fields["json"])
    if "choice" in fields:
        fields["choice"] = tuple(fields["choice"]) if isinstance(fields["choice"], list) else fields["choice"]
    return _structured(param="structured_outputs", **fields)


def _structured(param: str, **fields: Any) -> StructuredOutputs:
    try:
        return StructuredOutputs(**fields)
    except (ValueError, TypeError) as e:
        raise bad_request(str(e), param) from None


def _dumps(schema: Any) -> str:
    return json.dumps(schema, separators=(",", ":"))


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    # vLLM extra: per prompt token, its logprob and the top-k (each choice's `prompt_logprobs`)
    prompt_logprobs: int | None = None

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt scored, nothing generated (as OpenAI and vLLM)."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: a string or a token-id list is a batch of one."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]  # type: ignore[list-item]
        if not self.prompt:
            raise bad_request("the prompt is empty", "prompt")
        return list(self.prompt)  # type: ignore[arg-type]

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of must equal n (no server-side ranking)", "best_of")
        if self.stream and self.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs are not available when streaming (echo with logprobs streams them)",
                              "prompt_logprobs")  # fmt: skip
        # The engine samples at least one token: with echo only, that one is computed and dropped.
        params = self.sampling_params(1 if self.echo_only else self.max_tokens, self.logprobs)
        # Echo with logprobs reports the prompt's tokens too, with the same top-k (as vLLM).
        prompt_logprobs = self.prompt_logprobs if self.prompt_logprobs is not None else self.logprobs if self.echo else None
        try:
            return replace(params, prompt_logprobs=prompt_logprobs)
        except ValueError as e:
            raise bad_request(str(e), "prompt_logprobs") from None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"] = "function"
    function: FunctionName


def _choice_name(choice: str | NamedToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else f"{{function: {choice.function.name!r}}}"


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_call_id, ... reach the template
    role: str
    content: str | list[dict[str, Any]] | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template reads it: text content as a string; with images or
        videos, a list of parts ({"type": "text", "text": ...}, {"type": "image"}, {"type": "video"})."""
        message = self.model_dump(exclude_none=True)
        parts = self._parts()
        media = any(p["type"] != "text" for p in parts)
        message["content"] = parts if media else "".join(p["text"] for p in parts)
        if isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [_with_argument_dict(call) for call in message["tool_calls"]]
        return message

    def media(self, index: int) -> list[MediaPart]:
        """This message's (index `index`) images and videos, in order."""
        if not isinstance(self.content, list):
            return []
        return [MediaPart(MEDIA_PARTS[part["type"]], part[part["type"]]["url"], f"messages[{index}].content[{j}]")
                for j, part in enumerate(self.content) if part.get("type") in MEDIA_PARTS]  # fmt: skip

    def _parts(self) -> list[dict[str, str]]:
        if self.content is None or isinstance(self.content, str):
            return [{"type": "text", "text": self.content or ""}]
        parts = []
        for part in self.content:
            kind = part.get("type")
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind in MEDIA_PARTS:
                ref = part.get(kind)
                if not isinstance(ref, dict) or not isinstance(ref.get("url"), str):
                    raise bad_request(f'a {kind} part needs {{"{kind}": {{"url": "..."}}}}', "messages")
                parts.append({"type": MEDIA_PARTS[kind]})
            else:
                raise bad_request(f"content parts of type {kind!r} are not supported; send text, image_url or video_url",
                                  "messages")  # fmt: skip
        return parts


MEDIA_PARTS = {"image_url": "image", "video_url": "video"}  # content part type -> modality


@dataclass(frozen=True)
class MediaPart:
    modality: str  # "image" | "video"
    url: str
    where: str  # the part, for error messages: messages[i].content[j]


def _with_argument_dict(call: Any) -> Any:
    """OpenAI sends a call's arguments as a JSON string; chat templates iterate a mapping."""
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError:
            raise bad_request(f"the arguments of tool call {call.get('id')!r} are not valid JSON", "messages") from None
        return {**call, "function": {**function, "arguments": arguments}}
    return call


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM extras
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" when tools are given, else "none"."""
        return self.tool_choice if self.tool_choice is not None else "auto" if self.tools else "none"

    def media(self) -> list[MediaPart]:
        """Every image and video of the conversation, in the order the template renders them."""
        return [part for i, m in enumerate(self.messages) for part in m.media(i)]

    def forced_tools(self) -> list[dict[str, Any]] | None:
        """The functions a call must be made to (`required`: any; named: that one), or None."""
        choice = self.effective_tool_choice
        if choice in ("none", "auto"):
            return None
        if not self.tools:
            raise bad_request(f"tool_choice {_choice_name(choice)} needs tools", "tool_choice")
        functions = [t.function.model_dump(exclude_none=True) for t in self.tools]
        if choice == "required":
            return functions
        named = [f for f in functions if f["name"] == choice.function.name]  # type: ignore[union-attr]
        if not named:
            known = ", ".join(f["name"] for f in functions)
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools ({known})", "tool_choice")  # type: ignore[union-attr]
        return named

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)
