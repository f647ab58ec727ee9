"""The Responses API routes: create, retrieve (or re-attach to the stream), delete, cancel.

    POST /v1/responses --> ResponsesRequest --> ChatCompletionRequest --> prepare_chat, submit
                           --> a task running `generate` (held by the store) --> ResponseRecord events
       stream:      the SSE stream follows the record's events (client gone: the task is cancelled)
       background:  the record's body at once; the task runs on, whoever reads it
       otherwise:   the body once the task is done (client gone: the task is cancelled)
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from oxserve.server import openapi
from oxserve.server.protocol import APIError, bad_request, read_body
from oxserve.server.quotas import quota_of
from oxserve.server.responses.events import generate
from oxserve.server.responses.protocol import InputItem, ResponsesRequest, parse_items, parse_request
from oxserve.server.responses.store import DEFAULT_MAX_STORED, InFlight, ResponseRecord, ResponseStore
from oxserve.server.serving import OpenAIServing, until_disconnected


class EventStream(StreamingResponse):
    """An SSE stream of a record's events; `on_close` runs however it ends (client gone included)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], object] | None):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.on_close is not None:
                self.on_close()


def add_responses_routes(app: FastAPI, serving: OpenAIServing, in_flight: InFlight | None = None,
                         max_stored: int = DEFAULT_MAX_STORED) -> ResponseStore:  # fmt: skip
    """Registers the routes; each running response counts in `in_flight` (so a drain waits for
    background ones too), and the app closes the store (cancelling what runs) on shutdown."""
    store = ResponseStore(max_stored, in_flight)

    def history(req: ResponsesRequest) -> list[InputItem]:
        """The conversation so far: the previous response's input and output items."""
        if req.previous_response_id is None:
            return []
        previous = store.get(req.previous_response_id)
        if not previous.done:
            raise bad_request(f"the response {previous.id!r} is still {previous.status}; wait for it to end", "previous_response_id")
        return previous.history + parse_items(previous.output, "previous_response_id")

    @app.post("/v1/responses", openapi_extra=openapi.body(ResponsesRequest), responses=openapi.answers(None, streams=True))
    async def create(request: Request) -> Response:
        req = parse_request(await read_body(request))
        if req.background and not req.store:
            raise bad_request("a background response must be stored: drop store: false", "background")
        items = history(req) + req.input_items()
        response_id = f"resp_{uuid.uuid4().hex}"
        job, turn = await serving.prepare_chat(req.to_chat(items), response_id)
        group = await serving.submit(job, req.stream, quota_of(request))
        record = ResponseRecord(response_id, req, items, job.model)
        record.emit("response.created", response=record.body())
        if req.store:
            store.add(record)
        task = store.run(record, group, generate(record, job, turn, group))
        if req.stream:
            return EventStream(record.follow(-1), None if req.background else task.cancel)
        if req.background:
            return JSONResponse(record.body())
        if await until_disconnected(request, record.wait()) is None:
            task.cancel()
            return Response(status_code=499)  # the client is gone; nobody reads this
        if record.status == "failed":
            raise APIError(500, record.error["message"], "server_error")  # type: ignore[index]
        return JSONResponse(record.body())

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request) -> Response:
        record = store.get(response_id)
        query = request.query_params
        stream = query.get("stream", "false").lower()
        if stream not in ("true", "false"):
            raise bad_request("stream must be true or false", "stream")
        if stream == "false":
            return JSONResponse(record.body())
        try:
            after = int(query.get("starting_after", "-1"))
        except ValueError:
            raise bad_request("starting_after must be an integer (a sequence number)", "starting_after") from None
        return EventStream(record.follow(after), None)  # a follower leaving changes nothing for the response

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict:
        record = store.delete(response_id)
        if record.task is not None:  # nobody could read it any more: stop generating it
            record.task.cancel()
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> Response:
        record = store.get(response_id)
        if not record.request.background:
            raise bad_request("only background responses can be cancelled", "response_id")
        # A finished response is returned as it is (as OpenAI does: cancelling is idempotent).
        if not record.done and record.task is not None:
            record.task.cancel()
            await record.wait()
        return JSONResponse(record.body())

    return store
