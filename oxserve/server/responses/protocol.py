"""The Responses API request and its conversion to the chat request it runs as.

    input items (+ the previous response's items) --> chat messages
    tools / tool_choice (flat Responses shape)     --> chat ToolDefinition / NamedToolChoice
    text.format                                    --> response_format
    max_output_tokens                              --> max_tokens

Fields the server does not know are a 400 naming them, so a client never silently loses a
setting; vLLM's sampling extras and `chat_template_kwargs` are accepted as on chat.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError

from oxserve.server.protocol import INT64_MAX, INT64_MIN, ChatCompletionRequest, bad_request, validation_error


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class _Lenient(BaseModel):
    """Items a client echoes back from an earlier output carry ids, statuses, annotations: ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Lenient):
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningText(_Lenient):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Lenient):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None

    @property
    def text(self) -> str:
        # The full reasoning when the item has it; else what the summary says.
        return "".join(p.text for p in (self.content if self.content else self.summary))


def _item_type(value: Any) -> str | None:
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]
_ITEMS = TypeAdapter(list[InputItem])


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.schema_ is None:
            raise bad_request("text.format json_schema needs a schema", "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": self.name or "output", "schema": self.schema_, "strict": self.strict}}

    def echo(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(_Strict):
    format: TextFormat | None = None


class ReasoningConfig(_Strict):
    effort: str | None = None  # accepted and ignored: the model's thinking is on or off (chat_template_kwargs)
    summary: str | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    # Extra output OpenAI can add (encrypted reasoning, logprobs, ...): accepted, as agent
    # frameworks send it, but none of it is produced here.
    include: list[str] | None = None
    # vLLM extras, as on chat
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def input_items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return parse_items(self.input, "input")

    def to_chat(self, history: list[InputItem]) -> ChatCompletionRequest:
        """The chat request this response runs as: `history` is the whole conversation (the
        previous responses' items, then this request's input)."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions is not None else []) + chat_messages(history)
        if not messages:
            raise bad_request("the input is empty", "input")
        fields: dict[str, Any] = {
            "messages": messages,
            "max_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self.text.format.response_format() if self.text and self.text.format else None,
            **self.model_dump(include=_PASSED_THROUGH, exclude_none=True),
        }
        if self.tools:
            fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as e:
            raise validation_error(e) from None


_PASSED_THROUGH = {"model", "temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "stop", "stop_token_ids", "ignore_eos", "chat_template_kwargs"}  # fmt: skip


def parse_request(body: bytes) -> ResponsesRequest:
    try:
        return ResponsesRequest.model_validate_json(body)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        if first["type"] == "extra_forbidden":
            name = ".".join(map(str, first["loc"]))
            raise bad_request(f"the field {name!r} is not supported by this server", name) from None
        raise validation_error(e) from None


def parse_items(raw: list[Any], param: str) -> list[InputItem]:
    try:
        return _ITEMS.validate_python(raw)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = ".".join(map(str, (param, *err["loc"])))
        raise bad_request(f"{where}: {err['msg']}", where) from None


def chat_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Responses items as chat messages. One assistant turn of the Responses API is several
    items (reasoning, message, function calls); chat has them in one assistant message."""
    messages: list[dict[str, Any]] = []

    def assistant_turn(fresh: bool) -> dict[str, Any]:
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant" or fresh:
            last = {"role": "assistant", "content": ""}
            messages.append(last)
        return last

    for item in items:
        if isinstance(item, ReasoningItem):
            assistant_turn(fresh=True)["reasoning_content"] = item.text
        elif isinstance(item, MessageItem) and item.role == "assistant":
            last = messages[-1] if messages else None
            # Text after reasoning belongs to its turn; after other text or calls it starts a new one.
            turn = assistant_turn(fresh=last is None or bool(last.get("content")) or "tool_calls" in last)
            turn["content"] = _text(item.content)
        elif isinstance(item, MessageItem):
            messages.append({"role": "system" if item.role == "developer" else item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            assistant_turn(fresh=False).setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return messages


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)
