"""`oxserve serve`: the OpenAI-compatible HTTP server.

SIGTERM (or Ctrl-C) drains: new requests get 503, requests in flight finish (up to
`--shutdown-timeout`, then they are aborted), and the process exits 0. A second signal
stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path
from types import FrameType

import torch
import uvicorn

from oxserve.cli import add_engine_arguments, engine_config_from_args
from oxserve.disagg.connector import TRANSPORTS, KVReceiver, KVSender
from oxserve.disagg.launch import run_deployment
from oxserve.default_model import default_model
from oxserve.disagg.encoder import Encoder, build_encoder_app
from oxserve.disagg.router import MODES, Router, build_router_app, parse_instance
from oxserve.feedback.machine import data_dir
from oxserve.parallel.workers import serve_node
from oxserve.server.app import ServerState, build_app
from oxserve.server.async_engine import AsyncEngine
from oxserve.server.chat_turn import ChatParsing
from oxserve.server.deadlines import deadline_protocol
from oxserve.server.parsers import REASONING_PARSERS, TOOL_PARSERS
from oxserve.server.quotas import KeyQuota, load_keys

log = logging.getLogger("oxserve.server")

ROLES = ("colocated", "prefill", "decode", "encode", "router")

API_KEY_ENV = "OXSERVE_API_KEY"
ENGINE_WATCH_INTERVAL_S = 0.5  # how soon a dead engine stops the server


def _media_dir(value: str) -> Path:
    path = Path(value)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} is not a directory")
    return path.resolve()


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    group = parser.add_argument_group("server options")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for all (default: %(default)s)")
    group.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    group.add_argument("--served-model-name", default=None, help="model name in the API (default: --model, or 'oxserve-default')")
    group.add_argument("--max-waiting", type=int, default=256,
                       help="requests that may wait for a batch slot; beyond it, 429 with Retry-After (default: %(default)s)")  # fmt: skip
    group.add_argument("--max-waiting-tokens", type=int, default=1 << 20,
                       help="tokens the waiting requests may hold (prompts not computed yet); beyond it, 429 with "
                            "Retry-After, and a request holding more is refused with 400 (default: %(default)s)")  # fmt: skip
    group.add_argument("--max-queue-time", type=float, default=600.0,
                       help="seconds a request may wait to start; past it, 503 (code queue_timeout): its client has "
                            "likely given up (openai's default timeout is 600 s; 0: no bound; default: %(default)s)")  # fmt: skip
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM, seconds to let in-flight requests finish before aborting them (default: %(default)s)")  # fmt: skip
    group.add_argument("--allowed-local-media-path", type=_media_dir, default=None, metavar="DIR",
                       help="image_url / video_url parts may name local files (file:// URLs or paths) under DIR; "
                            "without it only data: URLs are taken (remote URLs never are)")  # fmt: skip
    roles = parser.add_argument_group("disaggregated serving (docs/disaggregation.md)")
    roles.add_argument("--role", choices=ROLES, default="colocated",
                       help="colocated: a whole server; prefill: also exports a prompt's caches to a decode instance when "
                            "a router asks; decode: also takes caches on --kv-port; encode: only the vision tower, sending "
                            "embeddings to instances' --mm-port; router: no engine, the OpenAI API in front of --prefill, "
                            "--decode and --encode instances (default: %(default)s)")  # fmt: skip
    roles.add_argument("--kv-port", type=int, default=0,
                       help="decode: the port prefill instances send caches to (0: any free one, logged; default: %(default)s)")
    roles.add_argument("--mm-port", type=int, default=None,
                       help="take image and video embeddings from encode instances on this port (0: any free one, logged)")
    roles.add_argument("--kv-transport", choices=TRANSPORTS, default="tcp",
                       help="prefill: how cache tensors travel: over the connection's socket (tcp) or a torch.distributed "
                            "gloo pair group (gloo); headers and the layout handshake always go over TCP (default: %(default)s)")  # fmt: skip
    roles.add_argument("--kv-debug", action="store_true", help="prefill: checksum every transfer (the receiver verifies it)")
    roles.add_argument("--prefill", action="append", default=[], metavar="URL[,mm=HOST:PORT]",
                       help="router: a prefill instance, and its --mm-port address if it has one (repeatable)")
    roles.add_argument("--decode", action="append", default=[], metavar="URL,KVHOST:KVPORT[,mm=HOST:PORT]",
                       help="router: a decode instance, its KV address and its --mm-port address (repeatable)")
    roles.add_argument("--encode", action="append", default=[], metavar="URL", help="router: an encode instance (repeatable)")
    roles.add_argument("--disaggregate", choices=MODES, default="auto",
                       help="router: split requests into prefill and decode always, never, or when measured costs say it "
                            "pays (auto; default: %(default)s)")  # fmt: skip
    roles.add_argument("--max-stall-ms", type=float, default=100.0,
                       help="router, auto: split a prompt whose colocated prefill would stall the decode instance's "
                            "requests longer than this, whatever else the cost rule says (default: %(default)s)")  # fmt: skip
    roles.add_argument("--epd-config", type=Path, default=None, metavar="YAML",
                       help="start a router with prefill and decode instances on this host, as the file says, and stop "
                            "them with it (docs/disaggregation.md)")  # fmt: skip
    group.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                       help="read tool calls in this model family's format out of chat outputs (needed for tools)")  # fmt: skip
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model decide when to call tools (tool_choice "auto", the default when tools are sent)')  # fmt: skip
    group.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                       help="separate the model's reasoning (<think>...</think>) into reasoning_content")  # fmt: skip
    group.add_argument("--api-key", default=None, metavar="KEY",
                       help=f"require 'Authorization: Bearer KEY' on every route but /health and /metrics; without the flag, "
                            f"read from ${API_KEY_ENV} (safer: a flag shows in ps); neither: no key needed")  # fmt: skip
    group.add_argument("--api-keys", type=Path, default=None, metavar="FILE",
                       help="YAML of API keys, each with a name and optional limits (requests_per_minute, tokens_per_minute, "
                            "max_concurrent); with --api-key, both are accepted")  # fmt: skip
    group.add_argument("--api-key-protects-metrics", action="store_true", help="require the API key on /metrics too")
    group.add_argument("--step-timeout", type=float, default=120.0,
                       help="seconds one engine step may run; past it the engine is taken as hung: every request fails "
                            "and the server exits with status 1 for a supervisor to restart (0: no limit; default: %(default)s)")  # fmt: skip
    group.add_argument("--header-read-timeout", type=float, default=10.0,
                       help="seconds a connection may take to send a request's headers before it is closed (default: %(default)s)")  # fmt: skip
    group.add_argument("--body-read-timeout", type=float, default=60.0,
                       help="seconds a request may take to send its body before a 408 (default: %(default)s)")  # fmt: skip
    group.add_argument("--max-connections", type=int, default=1024,
                       help="open connections (and requests) beyond which a new request gets 503 (default: %(default)s)")  # fmt: skip
    group.add_argument("--batch-store", type=Path, default=None, metavar="PATH",
                       help="SQLite file of the Files and Batch APIs' jobs, kept across restarts; one server at a time "
                            "(default: batches-PORT.sqlite in oxserve's data directory)")  # fmt: skip
    group.add_argument("--batch-concurrency", type=int, default=8,
                       help="lines of a batch job in the engine at once, sent only while no request waits (default: %(default)s)")
    group.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="(default: %(default)s)")
    group.add_argument("--no-access-log", dest="access_log", action="store_false", help="do not log one line per HTTP request")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_waiting < 1 or args.max_waiting_tokens < 1:
        raise SystemExit(f"--max-waiting and --max-waiting-tokens must be >= 1, got {args.max_waiting}, {args.max_waiting_tokens}")
    if args.max_queue_time < 0:
        raise SystemExit(f"--max-queue-time must be >= 0 (0: no bound), got {args.max_queue_time}")
    if args.step_timeout < 0:
        raise SystemExit(f"--step-timeout must be >= 0 (0: no limit), got {args.step_timeout}")
    if args.batch_concurrency < 1:
        raise SystemExit(f"--batch-concurrency must be >= 1, got {args.batch_concurrency}")
    if min(args.header_read_timeout, args.body_read_timeout) <= 0 or args.max_connections < 1:
        raise SystemExit("--header-read-timeout and --body-read-timeout must be > 0, --max-connections >= 1")
    try:
        parsing = ChatParsing(args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if args.epd_config is not None:
        return run_deployment(args.epd_config, args.host, args.port)
    if args.role in ("router", "encode"):
        if args.api_key or args.api_keys or os.environ.get(API_KEY_ENV):
            raise SystemExit(f"API keys are not checked by --role {args.role} yet; keep it and its instances on a "
                             "private network behind a gateway that checks them")  # fmt: skip
        return run_router(args) if args.role == "router" else run_encoder(args)
    keys = api_keys_from(args)
    engine_config = engine_config_from_args(args)
    if engine_config.parallel.node_rank > 0:  # another host's ranks: no engine, no HTTP server
        return serve_node(engine_config.parallel, torch.device(engine_config.model.device))
    engine = AsyncEngine(engine_config, args.max_waiting, max_waiting_tokens=args.max_waiting_tokens,
                         max_queue_time=args.max_queue_time or None)  # fmt: skip
    model_name = args.served_model_name or args.model or "oxserve-default"
    log.info("serving %s (%s) as %r, max_model_len %d", engine.model_path, args.dtype, model_name, engine.max_model_len)
    batch_store = args.batch_store or data_dir() / f"batches-{args.port}.sqlite"  # a restart on this port resumes its jobs
    try:
        app = build_app(engine, model_name, parsing, keys, args.api_key_protects_metrics, batch_store, args.batch_concurrency,
                        args.allowed_local_media_path)  # fmt: skip
    except ValueError as e:  # the batch store: in use by another server, or of another version
        raise SystemExit(str(e)) from None
    serving = app.state.serving
    if args.role == "prefill":
        serving.kv_sender = KVSender(engine.kv_description(), args.kv_transport, args.kv_debug)
    elif args.role == "decode":
        serving.kv_receiver = KVReceiver(engine.kv_description(), args.host, args.kv_port)
        log.info("decode instance: caches are taken on port %d", serving.kv_receiver.port)
    if args.mm_port is not None:
        try:
            serving.mm_receiver = KVReceiver(engine.mm_description(), args.host, args.mm_port)
        except ValueError as e:
            raise SystemExit(f"--mm-port: {e}") from None
        log.info("image and video embeddings are taken on port %d", serving.mm_receiver.port)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.access_log,
        # After the drain only stragglers are left (a client not sending or not reading): 2 s for them.
        timeout_graceful_shutdown=2, log_config=None,  # keep the logging set up above
        http=deadline_protocol(args.header_read_timeout, args.body_read_timeout, args.max_connections),
        ws="none",  # no websocket routes: an upgrade request is answered as plain HTTP
    )  # fmt: skip
    server = DrainingServer(config, app.state.server, args.shutdown_timeout, args.step_timeout or None)
    server.run()
    # Non-zero when the engine died: a supervisor restarts the server.
    return 0 if server.started and not server.engine_died else 1


def run_router(args: argparse.Namespace) -> int:
    try:
        router = Router([parse_instance(u, "prefill") for u in args.prefill], [parse_instance(d, "decode") for d in args.decode],
                        args.disaggregate, encode=[parse_instance(u, "encode") for u in args.encode],
                        max_stall_s=args.max_stall_ms / 1000)  # fmt: skip
    except ValueError as e:
        raise SystemExit(str(e)) from None
    log.info("router: %d prefill and %d decode instance(s), disaggregate %s", len(router.prefill), len(router.decode), args.disaggregate)
    uvicorn.run(build_router_app(router), host=args.host, port=args.port, log_level=args.log_level,
                access_log=args.access_log, log_config=None)  # fmt: skip
    return 0


def run_encoder(args: argparse.Namespace) -> int:
    path = Path(args.model) if args.model else default_model()
    try:
        encoder = Encoder(path, args.dtype, args.allowed_local_media_path, args.kv_transport, args.kv_debug)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    log.info("encode instance: the vision tower of %s (%s)", path, args.dtype)
    uvicorn.run(build_encoder_app(encoder), host=args.host, port=args.port, log_level=args.log_level,
                access_log=args.access_log, log_config=None)  # fmt: skip
    return 0


def api_keys_from(args: argparse.Namespace) -> dict[str, KeyQuota] | None:
    """The keys of --api-key (else $OXSERVE_API_KEY) and --api-keys, with their quotas; None:
    no key needed. Checked, and logged by source and name only, never by value."""
    keys: dict[str, KeyQuota] = {}
    source = "--api-key" if args.api_key is not None else API_KEY_ENV
    single = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if single is not None:
        keys[single] = KeyQuota("default")
    if args.api_keys is not None:
        source = args.api_keys if single is None else f"{source} and {args.api_keys}"
        try:
            from_file = load_keys(args.api_keys)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        if keys.keys() & from_file.keys():
            raise SystemExit(f"the key of {source.split(' and ')[0]} is also in {args.api_keys}")
        keys.update(from_file)
    if not keys:
        if args.api_key_protects_metrics:
            raise SystemExit(f"--api-key-protects-metrics needs an API key (--api-key, ${API_KEY_ENV} or --api-keys)")
        return None
    # A key has to travel in a header as is: visible ASCII, no spaces.
    for key, quota in keys.items():
        if not key or not all("!" <= c <= "~" for c in key):
            raise SystemExit(f"API key {quota.name!r} ({source}) must be non-empty visible ASCII without spaces")
    open_routes = "/health" if args.api_key_protects_metrics else "/health and /metrics"
    log.info("%d API key(s) required (from %s) on every route but %s", len(keys), source, open_routes)
    return keys


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains instead of closing the socket, and
    that it stops (exit status 1) when its engine dies or a step runs past `step_timeout`."""

    def __init__(self, config: uvicorn.Config, state: ServerState, timeout: float, step_timeout: float | None = None):
        super().__init__(config)
        self.state = state
        self.timeout = timeout
        self.step_timeout = step_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self.engine_died = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        watch = asyncio.ensure_future(self._watch_engine())
        try:
            await super().serve(sockets)
        finally:
            watch.cancel()

    async def _watch_engine(self) -> None:
        """A server whose engine is gone can only fail requests: stop it (exit status 1). A
        step that runs past the step timeout is a hung engine: its requests are failed first."""
        engine = self.state.engine
        while not self.should_exit:
            await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
            stalled = engine.stalled_for()
            if self.step_timeout is not None and stalled > self.step_timeout and engine.is_alive:
                s = engine.snapshot
                log.critical("an engine step has run for %.1f s (--step-timeout %g s) with %d request(s) running and %d "
                             "waiting; failing them all", stalled, self.step_timeout, s.num_running, s.num_waiting)  # fmt: skip
                engine.declare_stalled()
            if not engine.is_alive and not self.should_exit:
                log.critical("the engine thread is gone or hung; the server stops (exit status 1)")
                self.engine_died = True
                self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.draining or self._loop is None:
            return super().handle_exit(sig, frame)  # a second signal: stop now
        log.info("received %s", signal.Signals(sig).name)
        self.state.draining = True  # from here on new requests get 503
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        try:
            await self.state.drain(self.timeout)
        finally:  # whatever went wrong while draining, the server stops
            self.should_exit = True
