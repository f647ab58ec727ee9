"""`oxserve serve --role router`: the OpenAI API in front of prefill and decode instances.

Each chat or completion request either runs **colocated** on a decode instance (which is a
whole engine), or **split**: a prefill instance computes the prompt and its first token and
sends the caches to the decode instance (`kv_transfer_params`), which decodes the rest and
answers the client. `--disaggregate auto` decides per request from measured costs:

    colocated, the prompt's prefill (P tokens x s seconds a token) stalls each of the R requests
    the decode instance holds: R x P x s request-seconds of delay, spread over the others;
    split, this request alone waits: for the Q prefills ahead of it on the prefill instance
    (Q x P x s) and for the handover h;  split pays  <=>  Q x P x s + h < R x P x s, or the
    stall P x s alone is longer than --max-stall-ms (an inter-token gap no decode should see)

where s is measured on the prefill instances' answers, h (sending the caches and the decode
instance's first step) on split requests, and P is estimated from the prompt's characters
(characters per token and tokens per image learned from the instances' `usage`). Until s and
h are measured, a prompt splits when R > 0 and P >= PRIOR_SPLIT_TOKENS.

Instances are health-checked every HEALTH_INTERVAL_S; one that fails HEALTH_FAILURES checks in a
row (dead, or hung) is taken out, and requests waiting on it are retried elsewhere when nothing
has been streamed to their client yet (a failed prefill runs colocated; a failed decode runs
colocated on another decode instance), else end with an error event. No request waits on a
lost instance for more than about HEALTH_INTERVAL_S x (HEALTH_FAILURES + 1) + HEALTH_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

log = logging.getLogger("oxserve.router")

HEALTH_INTERVAL_S = 0.5
HEALTH_TIMEOUT_S = 1.5
HEALTH_FAILURES = 2
PRIOR_SPLIT_TOKENS = 512
DEFAULT_MAX_STALL_S = 0.1
MODES = ("auto", "always", "never")


class InstanceDown(Exception):
    pass


@dataclass
class Instance:
    url: str
    kind: str  # "prefill" | "decode"
    kv_address: str | None = None  # decode instances: where prefill instances send caches
    mm_address: str | None = None  # instances with --mm-port: where encode instances send embeddings
    healthy: bool = True
    failures: int = 0
    in_flight: int = 0
    down: asyncio.Event = field(default_factory=asyncio.Event)

    def mark(self, state: str) -> None:
        """A health check's outcome: "ok", "draining" (it answers 503: it finishes what it has,
        takes nothing new) or "failed" (no answer: dead or hung)."""
        self.failures = self.failures + 1 if state == "failed" else 0
        was = self.healthy
        self.healthy = state == "ok" or (state == "failed" and self.failures < HEALTH_FAILURES)
        if state == "failed" and self.failures == HEALTH_FAILURES:
            log.error("router: %s instance %s is down; its requests go elsewhere", self.kind, self.url)
            self.down.set()
        elif self.healthy and not was:
            log.info("router: %s instance %s is back", self.kind, self.url)
            self.down = asyncio.Event()


def parse_instance(spec: str, kind: str) -> Instance:
    """`URL[,mm=HOST:PORT]` (prefill, encode) or `URL,KVHOST:KVPORT[,mm=HOST:PORT]` (decode):
    the instance's HTTP address, its --kv-port and its --mm-port."""
    url, *rest = spec.split(",")
    mm = [r[3:] for r in rest if r.startswith("mm=")]
    kv = [r for r in rest if not r.startswith("mm=")]
    if kind == "decode" and (len(kv) != 1 or ":" not in kv[0]):
        raise ValueError(f"--decode takes URL,KVHOST:KVPORT[,mm=HOST:PORT], got {spec!r}")
    if kind != "decode" and kv:
        raise ValueError(f"--{kind} takes URL[,mm=HOST:PORT], got {spec!r}")
    return Instance(url.rstrip("/"), kind, kv[0] if kv else None, mm[0] if mm else None)


def media_parts(body: dict) -> list[dict]:
    """A chat body's images and videos, in order, as an encode instance takes them."""
    parts = []
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image_url", "video_url") and isinstance(part.get(kind), dict):
                parts.append({"modality": kind[:-4], "url": part[kind].get("url")})
    return parts


class Ewma:
    def __init__(self, weight: float = 0.2):
        self.value: float | None = None
        self.weight = weight

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.weight) * self.value + self.weight * x


@dataclass
class Costs:
    """What the router has measured, for the split-or-not choice."""

    prefill_s_per_token: Ewma = field(default_factory=Ewma)
    handover_s: Ewma = field(default_factory=Ewma)
    chars_per_token: Ewma = field(default_factory=Ewma)
    tokens_per_image: Ewma = field(default_factory=Ewma)

    def estimate_tokens(self, chars: int, images: int) -> float:
        cpt = self.chars_per_token.value or 4.0
        return chars / cpt + images * (self.tokens_per_image.value or 256.0)

    def learn_prompt(self, chars: int, images: int, tokens: int) -> None:
        if images and self.chars_per_token.value:
            self.tokens_per_image.add(max(0.0, (tokens - chars / self.chars_per_token.value) / images))
        elif not images and chars and tokens:
            self.chars_per_token.add(chars / tokens)

    def split_pays(self, tokens: float, running: int, queued: int, max_stall_s: float = math.inf) -> bool:
        """`running`: requests on the decode instance; `queued`: on the prefill instance."""
        rate, handover = self.prefill_s_per_token.value, self.handover_s.value
        if running == 0:
            return False  # nobody to stall: colocated costs no one anything
        if rate is None or handover is None:
            return tokens >= PRIOR_SPLIT_TOKENS
        stall = tokens * rate
        return stall > max_stall_s or queued * stall + handover < running * stall


def prompt_size(body: dict) -> tuple[int, int]:
    """(characters of text, images and videos) in a chat or completion body."""
    if "messages" in body:
        chars = 0
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content if isinstance(content, list) else []
            chars += sum(len(str(p.get("text", ""))) for p in parts if isinstance(p, dict) and p.get("type") == "text")
        return chars, len(media_parts(body))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt), 0
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return 4 * len(prompt), 0  # token ids: about a token's worth of characters each
    return sum(len(p) for p in prompt if isinstance(p, str)) if isinstance(prompt, list) else 0, 0


class Router:
    def __init__(self, prefill: list[Instance], decode: list[Instance], mode: str = "auto", timeout_s: float = 600.0,
                 encode: list[Instance] | None = None, max_stall_s: float = DEFAULT_MAX_STALL_S):  # fmt: skip
        if not decode:
            raise ValueError("the router needs at least one decode instance")
        if mode not in MODES:
            raise ValueError(f"--disaggregate must be one of {MODES}")
        if mode == "always" and not prefill:
            raise ValueError("--disaggregate always needs a prefill instance")
        self.prefill, self.decode, self.mode = prefill, decode, mode
        self.encode = encode or []
        self.max_stall_s = max_stall_s
        self.costs = Costs()
        # No pool limit: every stream holds a connection; health checks have their own client,
        # so a busy pool never makes an instance look dead.
        unbounded = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=HEALTH_TIMEOUT_S), limits=unbounded)
        self.health_client = httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S)
        self.affinity: OrderedDict[str, Instance] = OrderedDict()  # prompt prefix -> the decode instance that ran it
        self.counts = {"colocated": 0, "split": 0, "retried": 0, "failed": 0, "encoded_elsewhere": 0}
        self.encode_s_per_item = Ewma()

    # ---- health --------------------------------------------------------------------------
    async def watch(self) -> None:
        while True:
            await asyncio.gather(*(self._check(i) for i in self.prefill + self.decode + self.encode))
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _check(self, instance: Instance) -> None:
        try:
            status = (await self.health_client.get(f"{instance.url}/health")).status_code
            instance.mark("ok" if status == 200 else "draining" if status == 503 else "failed")
        except httpx.HTTPError:
            instance.mark("failed")

    # ---- choosing ------------------------------------------------------------------------
    def _pick(self, pool: list[Instance], key: str | None = None, avoid: Instance | None = None) -> Instance | None:
        """The least loaded healthy instance; among nearly as idle ones, the one that last ran
        this prompt's prefix (its prefix cache may hold it)."""
        alive = [i for i in pool if i.healthy and i is not avoid]
        if not alive:
            return None
        least = min(i.in_flight for i in alive)
        previous = self.affinity.get(key) if key else None
        if previous in alive and previous.in_flight <= least + 1:
            return previous
        return min(alive, key=lambda i: i.in_flight)

    def _remember(self, key: str | None, instance: Instance) -> None:
        if key:
            self.affinity[key] = instance
            self.affinity.move_to_end(key)
            while len(self.affinity) > 4096:
                self.affinity.popitem(last=False)

    def should_split(self, body: dict, decode: Instance) -> bool:
        if self.mode == "never" or not any(p.healthy for p in self.prefill):
            return False
        wanted = body.get("max_completion_tokens") or body.get("max_tokens")
        if body.get("n", 1) != 1 or wanted == 1 or body.get("prompt_logprobs") is not None or body.get("echo"):
            return False  # nothing to hand over, or what a handover cannot carry
        if isinstance(body.get("prompt"), list) and body["prompt"] and not isinstance(body["prompt"][0], int):
            return False  # several prompts in one request
        if self.mode == "always":
            return True
        prefill = self._pick(self.prefill)
        chars, media = prompt_size(body)
        tokens = self.costs.estimate_tokens(chars, media)
        return self.costs.split_pays(tokens, decode.in_flight, prefill.in_flight, self.max_stall_s)

    async def _with_embeddings(self, body: dict, target: Instance) -> dict:
        """`body`, its images and videos encoded on an encode instance and sent to `target`
        (named in kv_transfer_params), when the policy offloads them: always, or (auto) when
        `target` serves other requests that its own encoding would stall. Unchanged when not
        offloaded or when the encode instance fails (`target` then encodes them itself)."""
        media = media_parts(body)
        offload = self.mode == "always" or (self.mode == "auto" and target.in_flight > 0)
        encoder = self._pick(self.encode)
        if not media or not offload or encoder is None or target.mm_address is None:
            return body
        transfer = uuid.uuid4().hex
        started = time.monotonic()
        try:
            answer = await self._call(encoder, "/v1/encode", {"media": media, "send_to": target.mm_address, "transfer_id": transfer})
        except InstanceDown:
            return body
        if answer.status_code != 200:
            return body  # a bad part: the instance running the prompt answers the client's 400 itself
        self.encode_s_per_item.add((time.monotonic() - started) / len(media))
        self.counts["encoded_elsewhere"] += 1
        return {**body, "kv_transfer_params": {**(body.get("kv_transfer_params") or {}), "embeddings": transfer}}

    # ---- serving -------------------------------------------------------------------------
    async def handle(self, path: str, body: dict) -> Response:
        # Handover fields are the router's to set: from a client they could send caches anywhere.
        body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        key = json.dumps(body.get("messages") or body.get("prompt"), sort_keys=True)[:512]
        decode = self._pick(self.decode, key)
        if decode is None:
            return _error(503, "no decode instance is healthy")
        if self.should_split(body, decode):
            response = await self._split(path, body, decode)
            if response is not None:
                self.counts["split"] += 1
                self._remember(key, decode)
                return response
            self.counts["retried"] += 1  # the prefill failed: run it colocated instead
            decode = self._pick(self.decode, key) or decode
        self.counts["colocated"] += 1
        self._remember(key, decode)
        return await self._colocated(path, body, decode)

    async def _colocated(self, path: str, body: dict, decode: Instance, tried: int = 0) -> Response:
        started = time.monotonic()
        try:
            return await self._forward(decode, path, await self._with_embeddings(body, decode), learn=(body, started))
        except InstanceDown as e:
            other = self._pick(self.decode, avoid=decode)
            if other is None or tried >= len(self.decode):
                self.counts["failed"] += 1
                return _error(503, f"decode instance {decode.url} failed ({e}) and no other is healthy")
            self.counts["retried"] += 1
            return await self._colocated(path, body, other, tried + 1)

    async def _split(self, path: str, body: dict, decode: Instance) -> Response | None:
        """Prefill on a prefill instance, then decode on `decode` from its caches; None when
        the prefill could not be done (the caller runs the request colocated)."""
        prefill = self._pick(self.prefill)
        if prefill is None:
            return None
        transfer = uuid.uuid4().hex
        first = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
        first.update(max_tokens=1, stream=False, kv_transfer_params={"export_to": decode.kv_address, "transfer_id": transfer})
        first = await self._with_embeddings(first, prefill)
        started = time.monotonic()
        try:
            answer = await self._call(prefill, path, first)
        except InstanceDown:
            return None
        if answer.status_code != 200:
            if 400 <= answer.status_code < 500 and answer.status_code not in (408, 429):  # the request's own fault
                return Response(answer.content, answer.status_code, media_type="application/json")
            return None  # the prefill instance is full or failing: the decode instance may run it colocated
        done = answer.json()
        prefill_s = time.monotonic() - started
        tokens = done.get("usage", {}).get("prompt_tokens", 0)
        if tokens:
            self.costs.prefill_s_per_token.add(prefill_s / tokens)
            self.costs.learn_prompt(*prompt_size(body), tokens)
        if done["choices"][0].get("finish_reason") != "length":  # its first token ended it: nothing to decode
            return None
        second = {**body, "kv_transfer_params": {"import": transfer}}
        try:
            return await self._forward(decode, path, second, handover_from=time.monotonic())
        except InstanceDown:  # lost, or the caches did not arrive: the caller runs it colocated
            return None

    async def _call(self, instance: Instance, path: str, body: dict) -> httpx.Response:
        """One whole request to an instance; InstanceDown if it fails or goes down meanwhile."""
        instance.in_flight += 1
        try:
            return await _unless_down(instance, self.client.post(f"{instance.url}{path}", json=body))
        except httpx.HTTPError as e:
            raise InstanceDown(str(e)) from None
        finally:
            instance.in_flight -= 1

    async def _forward(self, instance: Instance, path: str, body: dict, learn: tuple | None = None,
                       handover_from: float | None = None) -> Response:  # fmt: skip
        """The instance's answer, streamed through as it comes; InstanceDown if it fails before
        its first byte (after that, a stream ends with an error event)."""
        instance.in_flight += 1
        request = self.client.build_request("POST", f"{instance.url}{path}", json=body)
        upstream = None
        try:
            upstream = await _unless_down(instance, self.client.send(request, stream=True))
            if upstream.status_code == 503:  # draining, or the caches never came: another instance may take it
                detail = (await upstream.aread())[:300].decode(errors="replace")
                raise InstanceDown(f"{instance.url} answered 503: {detail}")
            chunks = upstream.aiter_raw()
            first = await _unless_down(instance, anext(chunks, b""))
        except (httpx.HTTPError, InstanceDown) as e:
            instance.in_flight -= 1
            if upstream is not None:
                await upstream.aclose()
            raise InstanceDown(str(e)) from None
        if handover_from is not None and upstream.status_code == 200 and body.get("stream"):
            # A stream's first chunk is the handover's end; a whole answer comes only after the decode.
            self.costs.handover_s.add(time.monotonic() - handover_from)
        if not body.get("stream"):
            try:
                rest = b"".join([first] + [c async for c in chunks])
            except httpx.HTTPError as e:
                raise InstanceDown(str(e)) from None
            finally:
                await upstream.aclose()
                instance.in_flight -= 1
            if learn is not None and upstream.status_code == 200:
                self._learn_colocated(rest, *learn)
            return Response(rest, upstream.status_code, media_type=upstream.headers.get("content-type"))

        async def relay():
            try:
                yield first
                async for chunk in _iter_unless_down(instance, chunks):
                    yield chunk
            except (httpx.HTTPError, InstanceDown) as e:
                self.counts["failed"] += 1
                error = {"error": {"message": f"the decode instance failed mid-stream: {e}", "type": "server_error",
                                   "code": "instance_failed"}}  # fmt: skip
                yield f"data: {json.dumps(error)}\n\n".encode()
            finally:
                instance.in_flight -= 1
                await upstream.aclose()

        return StreamingResponse(relay(), upstream.status_code, media_type=upstream.headers.get("content-type"))

    def _learn_colocated(self, raw: bytes, body: dict, started: float) -> None:
        try:
            tokens = json.loads(raw).get("usage", {}).get("prompt_tokens", 0)
        except (json.JSONDecodeError, AttributeError):
            return
        if tokens:
            self.costs.learn_prompt(*prompt_size(body), tokens)

    async def models(self) -> Response:
        for instance in self.decode:
            if instance.healthy:
                try:
                    r = await self.client.get(f"{instance.url}/v1/models", timeout=HEALTH_TIMEOUT_S)
                    return Response(r.content, r.status_code, media_type="application/json")
                except httpx.HTTPError:
                    continue
        return _error(503, "no decode instance is healthy")


async def _unless_down(instance: Instance, awaitable):
    """`awaitable`'s result, or InstanceDown as soon as the instance is marked down."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(instance.down.wait())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        raise InstanceDown(f"{instance.kind} instance {instance.url} stopped answering its health checks")
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()


async def _iter_unless_down(instance: Instance, chunks):
    while True:
        chunk = await _unless_down(instance, anext(chunks, None))
        if chunk is None:
            return
        yield chunk


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": "no_instance"}}, status)


def build_router_app(router: Router) -> FastAPI:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health check
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        watcher = asyncio.create_task(router.watch())
        yield
        watcher.cancel()
        await router.client.aclose()
        await router.health_client.aclose()

    app = FastAPI(title="oxserve router", lifespan=lifespan, docs_url=None, redoc_url=None)

    async def proxy(request: Request, path: str) -> Response:
        try:
            body = json.loads(await request.body())
        except json.JSONDecodeError:
            return JSONResponse({"error": {"message": "the body is not JSON", "type": "invalid_request_error",
                                           "param": None, "code": None}}, 400)  # fmt: skip
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the body must be a JSON object", "type": "invalid_request_error",
                                           "param": None, "code": None}}, 400)  # fmt: skip
        return await router.handle(path, body)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy(request, "/v1/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        return await router.models()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if any(i.healthy for i in router.decode) else 503)

    @app.get("/router/stats")
    async def stats() -> dict:
        c = router.costs
        return {**router.counts, "prefill_s_per_token": c.prefill_s_per_token.value, "handover_s": c.handover_s.value,
                "encode_s_per_item": router.encode_s_per_item.value,
                "chars_per_token": c.chars_per_token.value, "tokens_per_image": c.tokens_per_image.value,
                "instances": [{"url": i.url, "kind": i.kind, "healthy": i.healthy, "in_flight": i.in_flight}
                              for i in router.prefill + router.decode + router.encode]}  # fmt: skip

    return app
