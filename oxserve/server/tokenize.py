"""vLLM's `/tokenize` and `/detokenize`: the engine's tokenizer over HTTP, chat template included.

    POST /tokenize    {"prompt": str} or {"messages": [...], "add_generation_prompt", "chat_template_kwargs", "tools"}
                      -> {"count", "max_model_len", "tokens", "token_strs"?}
    POST /detokenize  {"tokens": [int]} -> {"prompt": str}

The chat form renders exactly as /v1/chat/completions does, so its tokens are the prompt a
chat request would run. Prompts longer than the context are tokenized all the same (the
client compares `count` with `max_model_len`), as vLLM does.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from oxserve.server.protocol import ChatCompletionRequest, ChatMessage, ToolDefinition, bad_request, parse_body
from oxserve.server.serving import OpenAIServing
from oxserve.tokenizer import Tokenizer


class TokenizeRequest(BaseModel):
    """vLLM's two tokenize bodies as one: exactly one of `prompt` and `messages`. `add_special_tokens`
    is accepted for vLLM's clients; this tokenizer adds none either way (a chat template writes its own)."""

    model_config = ConfigDict(strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    model: str | None = None
    tokens: list[int]


class TokenizeServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.engine = serving.engine

    async def tokenize(self, body: bytes) -> dict[str, Any]:
        req: TokenizeRequest = parse_body(TokenizeRequest, body)
        self.serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send either prompt or messages, not both or neither", "prompt")
        tokenizer = self._tokenizer("prompt" if req.messages is None else "messages")
        text = req.prompt if req.messages is None else self._chat_prompt(req)
        # On a worker thread: a long text (and a token string per id) would stall the event loop.
        tokens, token_strs = await asyncio.to_thread(_encode, tokenizer, text, req.return_token_strs)  # type: ignore[arg-type]
        answer: dict[str, Any] = {"count": len(tokens), "max_model_len": self.engine.max_model_len, "tokens": tokens}
        if token_strs is not None:
            answer["token_strs"] = token_strs
        return answer

    async def detokenize(self, body: bytes) -> dict[str, Any]:
        req: DetokenizeRequest = parse_body(DetokenizeRequest, body)
        self.serving.check_model(req.model)
        tokenizer = self._tokenizer("tokens")
        vocab_size = self.engine.vocab_size
        if bad := [t for t in req.tokens if not 0 <= t < vocab_size]:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "tokens")
        # Special tokens kept, so that detokenize(tokenize(x)) gives x back, chat markup included.
        return {"prompt": await asyncio.to_thread(tokenizer.decode, req.tokens, False)}

    def _tokenizer(self, param: str) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise bad_request("this model has no tokenizer", param)
        return self.engine.tokenizer

    def _chat_prompt(self, req: TokenizeRequest) -> str:
        chat = ChatCompletionRequest(messages=req.messages, tools=req.tools, add_generation_prompt=req.add_generation_prompt,
                                     chat_template_kwargs=req.chat_template_kwargs)  # fmt: skip
        if parts := chat.media():  # their token count depends on decoding and resizing them
            raise bad_request("/tokenize does not take images or video; /v1/chat/completions reports their prompt tokens in usage",
                              parts[0].where)  # fmt: skip
        return self.serving.render_chat(chat)


def _encode(tokenizer: Tokenizer, text: str, with_strs: bool) -> tuple[list[int], list[str] | None]:
    tokens = tokenizer.encode(text)
    # Each token decoded alone, as the logprobs' token strings are.
    return tokens, [tokenizer.decode([t], skip_special_tokens=False) for t in tokens] if with_strs else None
