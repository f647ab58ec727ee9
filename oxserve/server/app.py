"""The FastAPI application: routes, OpenAI-shaped errors, in-flight tracking and draining."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from oxserve.faults import Faults
from oxserve.server import openapi
from oxserve.server.async_engine import AsyncEngine
from oxserve.server.auth import RequireAPIKey
from oxserve.server.batch.routes import add_batch_routes
from oxserve.server.batch.runner import BatchRunner
from oxserve.server.batch.store import BatchStore
from oxserve.server.chat_turn import ChatParsing
from oxserve.server.metrics import ServerMetrics
from oxserve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, read_body, validation_error
from oxserve.server.quotas import EnforceQuotas, KeyQuota
from oxserve.server.responses import add_responses_routes
from oxserve.server.serving import OpenAIServing
from oxserve.server.tokenize import DetokenizeRequest, TokenizeRequest, TokenizeServing

log = logging.getLogger(__name__)

# After the drain timeout: for aborted requests to send their answer. An abort takes effect
# at the end of the engine's current step, which under load can take seconds.
ABORT_GRACE_S = 10.0
ABORT_FLUSH_S = 0.5  # once the engine is empty: for the aborted answers to be sent
SHUTTING_DOWN = APIError(503, "the server is shutting down; retry on another replica", "service_unavailable", None,
                         "server_shutting_down")  # fmt: skip


class ServerState:
    """Requests in flight and whether the server is draining (SIGTERM: finish, accept no more)."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.draining = False
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()

    async def drain(self, timeout: float) -> None:
        """Stop taking requests, let in-flight ones finish; past `timeout`, abort them and give
        them ABORT_GRACE_S to answer. Returns by then whatever clients do: a request still
        waiting for its body is left to the server's shutdown, which closes its connection."""
        self.draining = True
        log.info("draining: %d request(s) in flight, waiting up to %.0fs", self.in_flight, timeout)
        try:
            await asyncio.wait_for(self.idle.wait(), timeout)
        except TimeoutError:
            log.warning("drain timeout: aborting %d request(s)", self.in_flight)
            self.engine.abort(None)
            if not await self._aborts_answered(ABORT_GRACE_S):
                log.warning("%d request(s) still in flight (a client not sending or not reading); closing anyway", self.in_flight)
        log.info("drained")

    async def _aborts_answered(self, timeout: float) -> bool:
        """Until every request has gone (True), or the engine holds none and their answers had
        ABORT_FLUSH_S to go out (a client still sending its body holds no engine request)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.idle.is_set():
            s = self.engine.snapshot
            if s.num_running == 0 and s.num_waiting == 0:
                await asyncio.sleep(ABORT_FLUSH_S)
                break
            await asyncio.sleep(0.05)
        return self.idle.is_set()


class TrackRequests:
    """ASGI middleware: counts API requests in flight (streams until their last byte) and
    answers 503 once draining. A pure ASGI wrapper, so streaming and cancellation pass through."""

    def __init__(self, app: ASGIApp, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        if self.state.draining:
            return await _error_response(SHUTTING_DOWN, retry_after=self.state.engine.retry_after())(scope, receive, send)
        self.state.enter()
        started = False

        async def send_tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except asyncio.CancelledError:
            # uvicorn cancels what is left when its shutdown times out: an answer in OpenAI's
            # shape rather than its plain-text 500.
            if not started:
                await _error_response(SHUTTING_DOWN)(scope, receive, send)
            raise
        finally:
            self.state.leave()


def build_app(engine: AsyncEngine, model_name: str, parsing: ChatParsing | None = None, keys: dict[str, KeyQuota] | None = None,
              protect_metrics: bool = False, batch_store: Path | None = None, batch_concurrency: int = 8,
              allowed_local_media_path: Path | None = None) -> FastAPI:  # fmt: skip
    """`keys`: API keys and their quotas; one is required on every route but /health (and
    /metrics unless `protect_metrics`). None: no key needed.
    `batch_store`: the SQLite file of the Files and Batch APIs (None: those routes are absent).
    `allowed_local_media_path`: the directory under which image and video parts may name local files."""
    metrics = ServerMetrics(lambda: engine.snapshot, list(keys.values()) if keys else [])
    engine.metrics = metrics
    serving = OpenAIServing(engine, model_name, parsing, allowed_local_media_path)
    tokenizing = TokenizeServing(serving)
    state = ServerState(engine)
    store = BatchStore(batch_store, Faults.from_env().batch_store_max_pages) if batch_store is not None else None
    batches = BatchRunner(store, serving, engine, batch_concurrency, accepting=lambda: not state.draining) if store else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        if batches is not None:
            batches.start()  # jobs a previous run left unfinished go on
        yield
        if batches is not None:
            await batches.close()  # lines in flight are aborted; they run again after a restart
            store.close()
        await responses.close()  # running responses are cancelled before the engine stops
        await engine.stop()

    app = FastAPI(title="oxserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    app.state.serving = serving  # the CLI gives it a cache sender or receiver (disaggregated roles)
    app.add_middleware(TrackRequests, state=state)
    if keys:  # added last, so outermost: a request without a key is not even counted
        app.add_middleware(EnforceQuotas, keys=keys)
        app.add_middleware(RequireAPIKey, api_keys=list(keys), protect_metrics=protect_metrics)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> Response:
        return _error_response(e, retry_after=engine.retry_after())

    @app.exception_handler(RequestValidationError)  # a query or path parameter FastAPI parsed (bodies are the routes')
    async def invalid_parameter(request: Request, e: RequestValidationError) -> Response:
        return _error_response(validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(e.status_code, str(e.detail), kind), e.headers)  # 405's Allow among them

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return _error_response(APIError(500, "internal server error (the server's log has the details)", "server_error"))

    @app.get("/health", response_class=Response, responses={200: {"description": "Serving (empty body)", "content": {}},
                                                           503: {"description": "Draining, or the engine is gone (empty body)", "content": {}}})  # fmt: skip
    async def health() -> Response:
        ok = engine.is_alive and not state.draining
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse)  # Prometheus text, not the JSON FastAPI would declare
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        # root is the served name, as vLLM's when the model is a name: the checkpoint's path is the host's business.
        return {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "oxserve",
                "root": model_name, "parent": None, "max_model_len": engine.max_model_len}  # fmt: skip

    @app.get("/v1/models", responses=openapi.answers(openapi.ModelList))
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", responses=openapi.answers(openapi.ModelCard))  # a served name may hold slashes (org/name)
    async def retrieve_model(model: str) -> dict:
        serving.check_model(model)
        return model_card()

    @app.post("/tokenize", openapi_extra=openapi.body(TokenizeRequest))
    async def tokenize(request: Request) -> dict:
        return await tokenizing.tokenize(await read_body(request))

    @app.post("/detokenize", openapi_extra=openapi.body(DetokenizeRequest))
    async def detokenize(request: Request) -> dict:
        return await tokenizing.detokenize(await read_body(request))

    @app.post("/v1/completions", openapi_extra=openapi.body(CompletionRequest),
              responses=openapi.answers(openapi.Completion, streams=True))  # fmt: skip
    async def completions(request: Request) -> Response:
        return await serving.completions(await read_body(request), request)

    @app.post("/v1/chat/completions", openapi_extra=openapi.body(ChatCompletionRequest),
              responses=openapi.answers(openapi.ChatCompletion, streams=True))  # fmt: skip
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(await read_body(request), request)


    responses = add_responses_routes(app, serving, state)
    if store is not None:
        add_batch_routes(app, store, batches)
    openapi.install(app)
    return app


def _error_response(e: APIError, headers: Mapping[str, str] | None = None, retry_after: int = 1) -> JSONResponse:
    headers = dict(headers or {})
    if e.status in (429, 503):
        headers["Retry-After"] = str(retry_after)
    headers.update(e.headers)  # the error's own (a rate limit's Retry-After) win
    return JSONResponse(e.body(), status_code=e.status, headers=headers or None)
