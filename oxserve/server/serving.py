"""The two generation endpoints: API request -> engine requests -> JSON response or SSE stream.

One API request becomes `len(prompts) * n` engine requests; choice i is prompt i // n,
sample i % n, with the parameters `SamplingParams.fan_out()` gives sample i % n (as
`LLM.generate` does), so each choice is reproducible on its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import jinja2
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from oxserve.disagg.connector import KVReceiver, KVSender, KVTransferError
from oxserve.disagg.snapshot import CacheSnapshot
from oxserve.engine.engine import PromptError, PromptInputs, check_prompt_ids
from oxserve.engine.output_text import TextDeltas
from oxserve.multimodal.media import MediaError, decode_image, decode_video, media_bytes
from oxserve.outputs import CompletionOutput, RequestOutput
from oxserve.sampling_params import SamplingParams
from oxserve.server.async_engine import AsyncEngine, EngineError, EngineRequest, QueueFullError, QueueTimeoutError, RequestGroup
from oxserve.server.chat_turn import ChatParsing, ChatTurn
from oxserve.server.logprobs import LogprobFormatter, joined
from oxserve.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    MediaPart,
    bad_request,
    parse_body,
)
from oxserve.server.quotas import KeyQuota, quota_of

log = logging.getLogger(__name__)

KV_WAIT_S = 10.0  # how long a decode instance waits for caches a prefill instance is sending



@dataclass
class Job:
    """One API request, tokenized and validated, as the engine requests it becomes."""

    response_id: str
    model: str
    params: SamplingParams
    prompts: list[list[int]]
    created: int
    priority: int = 0  # lower runs first, under --scheduling-policy priority
    mm_items: tuple = ()  # a chat's images and videos, placed in its one prompt
    export_to: tuple[str, str] | None = None  # disaggregation: (decode instance's KV address, transfer id)
    kv_import: CacheSnapshot | None = None  # disaggregation: the prefill instance's caches of the prompt
    kv_result: dict | None = None  # what the export did, reported in the response

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def engine_requests(self) -> list[EngineRequest]:
        children = self.params.fan_out()
        requests = []
        for i in range(self.num_choices):
            rid = self.response_id if self.num_choices == 1 else f"{self.response_id}-{i}"
            prompt = self.prompts[i // len(children)]
            if self.mm_items or self.export_to or self.kv_import is not None:
                prompt = {"prompt_token_ids": prompt, "mm_items": self.mm_items, "export_caches": self.export_to is not None,
                          "kv_import": self.kv_import}  # fmt: skip
            requests.append((rid, prompt, children[i % len(children)]))
        return requests

    def token_charge(self, max_model_len: int) -> int:
        """The most tokens this job can use: its prompts and, for each choice, max_tokens (or
        the rest of the context), as OpenAI counts a request against a tokens-per-minute limit."""
        n = self.params.n
        return sum(len(p) + n * (self.params.max_tokens or max_model_len - len(p)) for p in self.prompts)

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }


@dataclass
class CompletionChoices:
    """/v1/completions choices, whole or as stream chunks. With echo, the prompt's text comes
    first (in a stream, in the choice's first chunk) and with logprobs, its tokens' logprobs
    first too; `text_offset` counts from the start of the echoed text. With echo and
    max_tokens 0, the prompt alone: the one token the engine had to sample is left out."""

    request: CompletionRequest
    fmt: LogprobFormatter
    echoes: list[str] | None  # with echo: the text of each prompt

    def choice(self, i: int, out: RequestOutput, text: str, token_ids: list[int],
               logprobs: list[dict[int, float]] | None, offset: int, first: bool) -> dict[str, Any]:  # fmt: skip
        """Choice i from these new tokens of `out`; `offset`: characters of completion sent before them."""
        if self.request.echo_only:
            text, token_ids, logprobs = "", [], None if logprobs is None else []
        echo = self.echoes[i // self.request.n] if self.echoes is not None else ""
        lp = None
        if logprobs is not None:
            lp = self.fmt.completion(token_ids, logprobs, len(echo) + offset)
            if first and self.echoes is not None and out.prompt_logprobs is not None:
                lp = joined(self.fmt.completion(out.prompt_token_ids, out.prompt_logprobs, 0), lp)
        fields: dict[str, Any] = {"text": (echo if first else "") + text, "logprobs": lp}
        if self.request.prompt_logprobs is not None and out.prompt_logprobs is not None:
            fields["prompt_logprobs"] = self.fmt.prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs,
                                                                 out.prompt_token_ranks)  # fmt: skip
        return _choice(i, out.outputs[0], **fields)


class EngineStreamResponse(StreamingResponse):
    """An SSE response that aborts its engine requests however it ends (client gone included)."""

    def __init__(self, content: AsyncIterator[str], job: Job, group: RequestGroup):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.job, self.group = job, group

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.group.abort():
                log.info("%s: client disconnected; aborted", self.job.response_id)


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, parsing: ChatParsing | None = None,
                 allowed_local_media_path: Path | None = None):  # fmt: skip
        self.engine = engine
        self.model_name = model_name
        self.parsing = parsing or ChatParsing()
        self.allowed_local_media_path = allowed_local_media_path  # None: local media files refused
        self.kv_sender: KVSender | None = None  # --role prefill: exports caches to decode instances
        self.kv_receiver: KVReceiver | None = None  # --role decode: takes caches from prefill instances
        self.mm_receiver: KVReceiver | None = None  # --mm-port: takes embeddings from encode instances

    # ---- /v1/completions ----------------------------------------------------------------
    async def completions(self, body: bytes, raw: Request | None) -> Response:
        req: CompletionRequest = parse_body(CompletionRequest, body)
        self.check_model(req.model)
        params = req.to_sampling_params()
        texts = req.prompts()
        prompts = [await self._prompt_ids(p, params.max_tokens, "prompt") for p in texts]
        job = Job(f"cmpl-{uuid.uuid4().hex}", self.model_name, params, prompts, int(time.time()), req.priority)
        await self._handover(req, job)
        echoes = [self._echo_text(text, ids) for text, ids in zip(texts, prompts)] if req.echo else None
        shape = CompletionChoices(req, LogprobFormatter(self.engine.tokenizer, req.return_tokens_as_token_ids), echoes)
        group = await self.submit(job, req.stream, quota_of(raw))

        if req.stream:
            deltas = [TextDeltas(params) for _ in range(job.num_choices)]

            def render(i: int, out: RequestOutput) -> dict | None:
                first = deltas[i].tokens_sent == 0
                offset = deltas[i].text_sent
                c = out.outputs[0]
                text, token_ids, logprobs = deltas[i].next(c.text, c.token_ids, c.logprobs, c.finished)
                if not (token_ids or out.finished):
                    return None
                return shape.choice(i, out, text, token_ids, logprobs, offset, first)

            stream = self._sse(job, group, "text_completion", req.include_usage, render)
            return EngineStreamResponse(stream, job, group)

        finals = await self._collect(job, group, raw)
        if finals is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        await self._export(job, finals)
        choices = []
        for i, out in enumerate(finals):
            c = out.outputs[0]
            choices.append(shape.choice(i, out, c.text, c.token_ids, c.logprobs, 0, first=True))
        return _json(job, "text_completion", choices, finals)

    def _echo_text(self, prompt: str | list[int], token_ids: list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        if self.engine.tokenizer is None:
            raise bad_request("echo of a token-id prompt needs the model's tokenizer, and this model has none", "echo")
        return self.engine.tokenizer.decode(token_ids, skip_special_tokens=False)

    # ---- /v1/chat/completions -----------------------------------------------------------
    async def chat(self, body: bytes, raw: Request | None) -> Response:
        req: ChatCompletionRequest = parse_body(ChatCompletionRequest, body)
        job, turn = await self.prepare_chat(req, f"chatcmpl-{uuid.uuid4().hex}")
        await self._handover(req, job)
        params = job.params
        fmt = LogprobFormatter(self.engine.tokenizer, req.return_tokens_as_token_ids)
        top_k = req.top_logprobs or 0
        group = await self.submit(job, req.stream, quota_of(raw))

        if req.stream:
            deltas = [TextDeltas(params) for _ in range(job.num_choices)]
            parsers = [turn.parser() for _ in range(job.num_choices)]
            called = [False] * job.num_choices

            def render(i: int, c: CompletionOutput) -> list[dict]:
                first = deltas[i].tokens_sent == 0
                text, token_ids, logprobs = deltas[i].next(c.text, c.token_ids, c.logprobs, c.finished)
                if not (token_ids or c.finished):
                    return []
                lp = fmt.chat(token_ids, logprobs, top_k) if logprobs is not None else None
                # One chunk per parsed piece (content, reasoning, a tool call's name or
                # arguments), or an empty delta: clients that time chunks time tokens.
                pieces = parsers[i].push(text) + (parsers[i].finish() if c.finished else [])
                called[i] = called[i] or any("tool_calls" in p for p in pieces)
                pieces = pieces or [{}]
                if first:  # a choice's first chunk carries the role
                    pieces[0] = {"role": "assistant", **pieces[0]}
                chunks = [_choice(i, None, delta=p) for p in pieces]
                chunks[-1]["logprobs"] = lp
                if c.finished:
                    chunks.append(_choice(i, c, delta={}, finish_reason=turn.finish_reason(c, called[i])))
                return chunks

            stream = self._sse(job, group, "chat.completion.chunk", req.include_usage, lambda i, out: render(i, out.outputs[0]))
            return EngineStreamResponse(stream, job, group)

        finals = await self._collect(job, group, raw)
        if finals is None:
            return Response(status_code=499)
        await self._export(job, finals)
        choices = []
        for i, out in enumerate(finals):
            c = out.outputs[0]
            logprobs = fmt.chat(c.token_ids, c.logprobs, top_k) if c.logprobs is not None else None
            message, finish_reason = turn.message(c)
            choices.append(_choice(i, c, message=message, logprobs=logprobs, finish_reason=finish_reason))
        return _json(job, "chat.completion", choices, finals)

    async def prepare_chat(self, req: ChatCompletionRequest, response_id: str) -> tuple[Job, ChatTurn]:
        """A chat request, validated, rendered and tokenized: ready to submit (also for the
        Responses API, which is chat underneath)."""
        self.check_model(req.model)
        prompt_text = self.render_chat(req)
        turn = ChatTurn(req, self.parsing, prompt_text, self.engine.tokenizer)
        params = await self._checked(turn.sampling_params(req.to_sampling_params()))
        media = req.media()
        if media:
            inputs = await self._multimodal(prompt_text, media)
            prompt = await self._prompt_ids(inputs.token_ids, params.max_tokens, "messages")
            return Job(response_id, self.model_name, params, [prompt], int(time.time()), req.priority, inputs.mm_items), turn
        prompt = await self._prompt_ids(prompt_text, params.max_tokens, "messages")
        return Job(response_id, self.model_name, params, [prompt], int(time.time()), req.priority), turn

    async def _multimodal(self, prompt_text: str, media: list[MediaPart]) -> PromptInputs:
        """The rendered chat with its images and videos fetched, decoded, processed and placed
        (off the event loop: decoding and patching take a while); a 400 naming the bad part."""

        def load(part: MediaPart):
            try:
                data = media_bytes(part.url, self.allowed_local_media_path)
                return decode_image(data) if part.modality == "image" else decode_video(data)
            except MediaError as e:
                raise bad_request(f"{part.where}: {e}", part.where) from None

        def prepare() -> PromptInputs:
            loaded = [load(part) for part in media]
            data = {m: [x for part, x in zip(media, loaded) if part.modality == m] for m in ("image", "video")}
            try:
                return self.engine.check_prompt({"prompt": prompt_text, "multi_modal_data": data})
            except ValueError as e:
                raise bad_request(str(e), "messages") from None

        return await asyncio.to_thread(prepare)

    def render_chat(self, req: ChatCompletionRequest) -> str:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise bad_request("this model has no tokenizer, so no chat template; use /v1/completions with token ids")
        messages = [m.template_dict() for m in req.messages]
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:  # rendered even with tool_choice "none", as vLLM does: the model knows them
            kwargs.setdefault("tools", [t.model_dump(exclude_none=True) for t in req.tools])
        try:
            return tokenizer.apply_chat_template(messages, req.add_generation_prompt, **kwargs)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise bad_request(f"the chat template failed on these messages: {e}", "messages") from None

    # ---- disaggregation (docs/disaggregation.md) ------------------------------------------
    async def _handover(self, req, job: Job) -> None:
        """Read `kv_transfer_params`: embeddings an encode instance sent (any role with
        --mm-port); a prefill to export, or a decode to start from caches another instance
        sent (taken off the event loop: they may still be arriving)."""
        kv = req.kv_transfer_params
        if kv is None:
            return
        if "embeddings" in kv:
            await self._take_embeddings(kv["embeddings"])
        if job.num_choices != 1 or len(job.prompts) != 1:
            if "export_to" in kv or "import" in kv:
                raise bad_request("a cache handover takes one prompt and n=1", "kv_transfer_params")
        if "export_to" in kv:
            if self.kv_sender is None:
                raise bad_request("this instance does not export caches (start it with --role prefill)", "kv_transfer_params")
            if req.stream or job.params.max_tokens != 1 or not kv.get("transfer_id"):
                raise bad_request("an export runs the prompt and one token: max_tokens 1, no stream, a transfer_id",
                                  "kv_transfer_params")  # fmt: skip
            job.export_to = (kv["export_to"], kv["transfer_id"])
        elif "import" in kv:
            if self.kv_receiver is None:
                raise bad_request("this instance takes no caches (start it with --role decode)", "kv_transfer_params")
            try:
                job.kv_import = CacheSnapshot.of(await asyncio.to_thread(self.kv_receiver.take, kv["import"], KV_WAIT_S))
            except KVTransferError as e:
                raise APIError(503, str(e), "server_error", "kv_transfer_params", "kv_transfer_failed") from None
        elif "embeddings" not in kv:
            raise bad_request('kv_transfer_params take "embeddings", "export_to" and "transfer_id", or "import"',
                              "kv_transfer_params")  # fmt: skip

    async def _take_embeddings(self, transfer_id: str) -> None:
        if self.mm_receiver is None:
            raise bad_request("this instance takes no embeddings (start it with --mm-port)", "kv_transfer_params")
        try:
            parcel = await asyncio.to_thread(self.mm_receiver.take, transfer_id, KV_WAIT_S)
            self.engine.seed_embeddings(parcel.tensors)
        except (KVTransferError, ValueError) as e:
            raise APIError(503, str(e), "server_error", "kv_transfer_params", "kv_transfer_failed") from None

    async def _export(self, job: Job, finals: list[RequestOutput]) -> None:
        """Send a finished prefill's caches to the decode instance named in its request."""
        if job.export_to is None:
            return
        address, transfer_id = job.export_to
        snap = finals[0].kv_snapshot
        if snap is None:  # aborted or failed: nothing to send
            raise APIError(503, "the prefill did not finish; no caches to send", "server_error", "kv_transfer_params",
                           "kv_transfer_failed")  # fmt: skip
        try:
            await asyncio.to_thread(self.kv_sender.send, address, transfer_id, snap.parcel())
        except KVTransferError as e:
            raise APIError(503, str(e), "server_error", "kv_transfer_params", "kv_transfer_failed") from None
        job.kv_result = {"transfer_id": transfer_id, "bytes": snap.nbytes(), "prompt_tokens": snap.num_tokens}

    # ---- shared -------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           "invalid_request_error", "model", "model_not_found")  # fmt: skip

    async def _prompt_ids(self, prompt: str | list[int], max_tokens: int | None, param: str) -> list[int]:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise bad_request("this model has no tokenizer; send the prompt as a list of token ids", param)
            ids = await asyncio.to_thread(self.engine.tokenizer.encode, prompt)  # long texts would stall the loop
        else:
            ids = prompt
        try:
            check_prompt_ids(ids, self.engine.vocab_size, self.engine.max_model_len, max_tokens)
        except PromptError as e:
            raise bad_request(str(e), param if e.field == "prompt" else e.field) from None
        return ids

    async def _checked(self, params: SamplingParams) -> SamplingParams:
        """`params`, once the engine could run its output constraint (checked on a worker
        thread: a large schema compiles for a while); else a 400 saying why."""
        try:
            await asyncio.to_thread(self.engine.check_structured_outputs, params)
        except ValueError as e:
            raise bad_request(str(e), "response_format") from None
        return params

    async def submit(self, job: Job, stream: bool, quota: KeyQuota | None = None) -> RequestGroup:
        """Hand the job to the engine. With the `quota` of the request's API key: its tokens
        are charged first (a 429 past the key's limit), and what it did not generate is given
        back when it ends."""
        p = job.params
        log.info("%s: %d prompt(s), %d prompt tokens, n=%d, max_tokens=%s, temperature=%s, stream=%s",
                 job.response_id, len(job.prompts), job.prompt_tokens, p.n, p.max_tokens, p.temperature, stream)  # fmt: skip
        charge = job.token_charge(self.engine.max_model_len)
        if quota is not None:
            quota.charge_tokens(charge)
        try:
            group = await self.engine.submit(job.engine_requests(), job.priority)
        except BaseException as e:
            if quota is not None:
                quota.refund_tokens(charge)  # nothing of it runs
            if not isinstance(e, (ValueError, QueueFullError, EngineError)):
                raise
            error = engine_error(e)
            log.info("%s: rejected (%d): %s", job.response_id, error.status, error.message)
            raise error from None
        if quota is not None:
            group.when_done(lambda generated: quota.refund_tokens(charge - job.prompt_tokens - generated))
        return group

    async def _collect(self, job: Job, group: RequestGroup, raw: Request | None) -> list[RequestOutput] | None:
        """Every choice's final output, or None if the client disconnected first (then aborted).
        Without `raw` (a batch line) nobody can disconnect; a cancelled caller aborts it."""

        async def collect() -> list[RequestOutput]:
            finals: list[RequestOutput] = [None] * job.num_choices  # type: ignore[list-item]
            async for i, out in group.outputs():
                if out.finished:
                    finals[i] = out
            return finals

        start = time.monotonic()
        try:
            finals = await (collect() if raw is None else until_disconnected(raw, collect()))
        except EngineError as e:
            raise engine_error(e) from None
        finally:
            if group.abort():
                log.info("%s: %s; aborted", job.response_id, "client disconnected" if raw is not None else "cancelled")
        if finals is not None:
            _log_finished(job, finals, time.monotonic() - start)
            if any(f.outputs[0].finish_reason == "abort" for f in finals):  # the server aborted it: no partial answer
                raise SHUT_DOWN
        return finals

    async def _sse(
        self, job: Job, group: RequestGroup, kind: str, usage: bool, render
    ) -> AsyncIterator[str]:
        """SSE events: a chunk per output that brought new tokens (text may be empty: a token
        can end mid-character or be special), the usage chunk, [DONE]. As vLLM does, so
        clients that time chunks time tokens.

        An engine failure mid-stream ends it with an error event (as vLLM does); the status
        line is long gone by then.
        """
        start = time.monotonic()
        finals: list[RequestOutput] = []
        try:
            async for i, out in group.outputs():
                if out.finished:
                    finals.append(out)
                for choice in _as_list(render(i, out)):
                    yield _sse(_chunk(job, kind, [choice], usage))
        except EngineError as e:
            error = engine_error(e)
            log.info("%s: failed mid-stream: %s", job.response_id, error.message)
            yield _sse(error.body())
        else:
            if any(f.outputs[0].finish_reason == "abort" for f in finals):  # the server aborted it, not the client
                yield _sse(SHUT_DOWN.body())
                yield "data: [DONE]\n\n"
                return
            _log_finished(job, finals, time.monotonic() - start)
            if usage:
                tokens = sum(len(f.outputs[0].token_ids) for f in finals)
                yield _sse({**_chunk(job, kind, [], False), "usage": job.usage(tokens)})
        yield "data: [DONE]\n\n"


# A request the server aborted (a drain past --shutdown-timeout) while its client waited.
SHUT_DOWN = APIError(503, "the server is shutting down and aborted this request before it finished; retry it",
                     "server_error", None, "server_shutting_down")  # fmt: skip


def engine_error(e: Exception) -> APIError:
    if isinstance(e, QueueFullError):
        return APIError(429, str(e), "requests", None, "rate_limit_exceeded")
    if isinstance(e, QueueTimeoutError):
        return APIError(503, str(e), "server_error", None, "queue_timeout")
    if isinstance(e, EngineError):
        return APIError(500, str(e), "server_error")
    return bad_request(str(e))


async def until_disconnected(raw: Request, work) -> Any:
    """Runs `work` to its result, or cancels it and returns None when the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None


async def _disconnected(raw: Request) -> None:
    # The body is read already, so the next ASGI message can only be the disconnect.
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _choice(index: int, c: CompletionOutput | None, **fields: Any) -> dict[str, Any]:
    finish = c.finish_reason if c is not None else None
    stop_reason = c.stop_reason if c is not None else None
    return {"index": index, "finish_reason": finish, "stop_reason": stop_reason, **fields}


def _as_list(rendered: dict | list[dict] | None) -> list[dict]:
    """A render gives one choice chunk, several, or none."""
    return rendered if isinstance(rendered, list) else [] if rendered is None else [rendered]


def _chunk(job: Job, kind: str, choices: list[dict], usage_field: bool) -> dict[str, Any]:
    chunk = {"id": job.response_id, "object": kind, "created": job.created, "model": job.model, "choices": choices}
    if usage_field:
        chunk["usage"] = None  # OpenAI: null on every chunk but the last when include_usage is set
    return chunk


def _json(job: Job, kind: str, choices: list[dict], finals: list[RequestOutput]) -> JSONResponse:
    tokens = sum(len(f.outputs[0].token_ids) for f in finals)
    body = {"id": job.response_id, "object": kind, "created": job.created, "model": job.model,
            "choices": choices, "usage": job.usage(tokens)}  # fmt: skip
    if job.kv_result is not None:
        body["kv_transfer_params"] = job.kv_result
    return JSONResponse(body)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _log_finished(job: Job, finals: list[RequestOutput], seconds: float) -> None:
    tokens = sum(len(f.outputs[0].token_ids) for f in finals)
    reasons = ",".join(sorted({str(f.outputs[0].finish_reason) for f in finals}))
    log.info("%s: finished in %.2fs, %d completion tokens (%s)", job.response_id, seconds, tokens, reasons)
