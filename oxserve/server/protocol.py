"""Request bodies of the OpenAI API (plus vLLM's sampling extras) and their errors.

Bodies are validated strictly from JSON: a string where a number belongs is a 400, not a
silent coercion. Ranges are checked once, by `SamplingParams`, so the server and the
offline API reject the same values with the same messages.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from oxserve.sampling_params import SamplingParams

MAX_N = 128  # choices per prompt; a guard against one request filling the whole queue
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # as vLLM; seed + choice index stays in torch's range


class APIError(Exception):
    """An error with its HTTP status, rendered as OpenAI's `{"error": {...}}`."""

    def __init__(self, status: int, message: str, type: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(e: ValidationError) -> APIError:
    errors = e.errors(include_url=False)
    if errors and errors[0]["type"] == "json_invalid":
        return bad_request(f"the body is not valid JSON: {errors[0]['msg']}")
    parts = [f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in errors[:3]]
    param = ".".join(map(str, errors[0]["loc"])) if errors and errors[0]["loc"] else None
    return bad_request("; ".join(parts), param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields both endpoints share; unknown fields (e.g. `user`) are ignored, as OpenAI does."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False

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
            )
        except ValueError as e:
            raise bad_request(str(e)) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a batch: a string or a token-id list is a batch of one."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]  # type: ignore[list-item]
        if not self.prompt:
            raise bad_request("the prompt is empty", "prompt")
        return list(self.prompt)  # type: ignore[arg-type]

    def to_sampling_params(self) -> SamplingParams:
        if self.echo:
            raise bad_request("echo is not supported (prompt logprobs are not computed)", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of must equal n (no server-side ranking)", "best_of")
        return self.sampling_params(self.max_tokens, self.logprobs)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_call_id, ... reach the template
    role: str
    content: str | list[dict[str, Any]] | None = None

    def template_dict(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        message["content"] = self._text()
        return message

    def _text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"content parts of type {part.get('type')!r} are not supported; send text", "messages")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(self) -> SamplingParams:
        if self.tools:
            raise bad_request("tools are not supported", "tools")
        if self.response_format and self.response_format.get("type") != "text":
            raise bad_request("only response_format {'type': 'text'} is supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)
