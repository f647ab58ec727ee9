"""Per-key quotas (`--api-keys FILE`): requests per minute, tokens per minute and requests in
flight, with OpenAI's rate-limit headers on every response so a client sees a limit coming.

    keys:
      sk-team-a: {name: team-a, requests_per_minute: 60, tokens_per_minute: 40000, max_concurrent: 4}
      sk-nightly: {name: nightly}          # a valid key without limits

Each per-minute limit is a bucket that holds at most the limit and refills continuously at
limit/60 per second, so a client that waits a second gets a second's worth back rather than
a cliff at the minute's end. A POST takes one request when it arrives (a GET that only reads
takes none). A generation takes its tokens when it is submitted: its prompt plus `max_tokens`
for each choice (the most it can produce, as OpenAI counts), and what it did not generate
goes back to the bucket when it finishes. Batch lines run as the server's own work and take
nothing from the key that created the job.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from oxserve.server.auth import bearer_token
from oxserve.server.protocol import APIError

LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")


class Bucket:
    """Holds up to `capacity`; refills at capacity per minute, continuously."""

    def __init__(self, capacity: int, now: float):
        self.capacity = capacity
        self.rate = capacity / 60.0
        self._level = float(capacity)
        self._at = now

    def level(self, now: float) -> float:
        self._level = min(self.capacity, self._level + (now - self._at) * self.rate)
        self._at = now
        return self._level

    def take(self, n: int, now: float) -> bool:
        if self.level(now) < n:
            return False
        self._level -= n
        return True

    def give_back(self, n: int, now: float) -> None:
        self._level = min(self.capacity, self.level(now) + n)

    def seconds_until(self, n: float, now: float) -> float:
        """Until the bucket holds `n` (at most the capacity): when a request of n may pass."""
        return max(0.0, (min(n, self.capacity) - self.level(now)) / self.rate)


@dataclass
class KeyQuota:
    """One key's limits (None: unlimited) and where it stands."""

    name: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    in_flight: int = 0
    num_requests: int = 0  # admitted (metrics)
    num_tokens: int = 0  # charged and not given back: prompts and generated tokens
    num_limited: dict[str, int] = field(default_factory=dict)  # 429s by the limit that was reached
    requests: Bucket | None = field(default=None, repr=False)
    tokens: Bucket | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        now = time.monotonic()
        self.requests = Bucket(self.requests_per_minute, now) if self.requests_per_minute else None
        self.tokens = Bucket(self.tokens_per_minute, now) if self.tokens_per_minute else None

    def admit(self, counts_request: bool) -> None:
        """A request arrives: within the concurrency limit and (a POST) the request rate, or a 429."""
        if self.max_concurrent is not None and self.in_flight >= self.max_concurrent:
            raise self._exceeded("concurrent requests", self.max_concurrent, f"{self.in_flight} are in flight", 1.0)
        now = time.monotonic()
        if counts_request and self.requests is not None and not self.requests.take(1, now):
            raise self._exceeded("requests per minute", self.requests_per_minute, "none remain",
                                 self.requests.seconds_until(1, now))  # fmt: skip
        self.num_requests += 1

    def charge_tokens(self, n: int) -> None:
        """Take `n` tokens for a generation, or a 429 (a 400 if n is over the limit itself)."""
        if self.tokens is None:
            self.num_tokens += n
            return
        if n > self.tokens.capacity:
            raise APIError(400, f"this request may use {n} tokens (prompt + max_tokens per choice), over key "
                                f"{self.name!r}'s limit of {self.tokens_per_minute} tokens per minute: lower max_tokens",
                           "invalid_request_error", "max_tokens", "request_too_large")  # fmt: skip
        now = time.monotonic()
        if not self.tokens.take(n, now):
            remaining = math.floor(self.tokens.level(now))
            raise self._exceeded("tokens per minute", self.tokens_per_minute, f"this request needs {n}, {remaining} remain",
                                 self.tokens.seconds_until(n, now))  # fmt: skip
        self.num_tokens += n

    def refund_tokens(self, n: int) -> None:
        """Tokens charged and not used (a generation that stopped before max_tokens, or never ran)."""
        if n > 0:
            self.num_tokens -= n
            if self.tokens is not None:
                self.tokens.give_back(n, time.monotonic())

    def headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's x-ratelimit-* headers for the per-minute limits this key has."""
        now = time.monotonic()
        out = []
        for kind, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                out += [(f"x-ratelimit-limit-{kind}".encode(), str(bucket.capacity).encode()),
                        (f"x-ratelimit-remaining-{kind}".encode(), str(math.floor(bucket.level(now))).encode()),
                        (f"x-ratelimit-reset-{kind}".encode(), duration(bucket.seconds_until(bucket.capacity, now)).encode())]  # fmt: skip
        return out

    def _exceeded(self, what: str, limit: int, state: str, retry_s: float) -> APIError:
        self.num_limited[what] = self.num_limited.get(what, 0) + 1
        return APIError(429, f"rate limit reached for key {self.name!r}: {limit} {what} ({state}); retry in {duration(retry_s)}",
                        "requests", None, "rate_limit_exceeded", {"Retry-After": str(max(1, math.ceil(retry_s)))})  # fmt: skip


def duration(seconds: float) -> str:
    """OpenAI's reset format: '1s', '6m0s', '120ms'."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"


def load_keys(path: Path) -> dict[str, KeyQuota]:
    """The keys file: `keys:` mapping each key to its name and limits (each a positive integer)."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read the keys file {path}: {e}") from None
    keys = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(keys, dict) or not keys:
        raise ValueError(f"{path}: expected a non-empty 'keys:' mapping of key -> limits")
    quotas: dict[str, KeyQuota] = {}
    for i, (key, spec) in enumerate(keys.items()):
        spec = spec or {}
        if not isinstance(key, str) or not key.strip() or not isinstance(spec, dict):
            raise ValueError(f"{path}: key #{i + 1} must be a non-empty string mapped to its limits")
        unknown = set(spec) - {"name", *LIMIT_FIELDS}
        if unknown:
            raise ValueError(f"{path}: key #{i + 1} has unknown fields {sorted(unknown)}; known: name, {', '.join(LIMIT_FIELDS)}")
        for f in LIMIT_FIELDS:
            if f in spec and not (isinstance(spec[f], int) and not isinstance(spec[f], bool) and spec[f] > 0):
                raise ValueError(f"{path}: key #{i + 1}: {f} must be a positive integer, got {spec[f]!r}")
        name = str(spec.get("name", f"key-{i + 1}"))  # metrics and errors name keys, never show them
        quotas[key] = KeyQuota(name, *(spec.get(f) for f in LIMIT_FIELDS))
    if len({q.name for q in quotas.values()}) != len(quotas):
        raise ValueError(f"{path}: key names must be unique")
    return quotas


SCOPE_KEY = "oxserve.quota"  # where the middleware leaves a request's KeyQuota for its route
UNCOUNTED_PATHS = ("/health", "/metrics")  # probes: never refused for a quota


def quota_of(raw: Request | None) -> KeyQuota | None:
    """The quota of the key an HTTP request came with (None: no limits apply, or no HTTP)."""
    return None if raw is None else raw.scope.get(SCOPE_KEY)


class EnforceQuotas:
    """ASGI middleware inside the key check: a key's concurrency and request-rate limits before
    its request runs (a 429 naming the limit), the x-ratelimit-* headers on every response it
    gets, and its quota in the scope for the route to charge tokens to (`quota_of`)."""

    def __init__(self, app: ASGIApp, keys: dict[str, KeyQuota]):
        self.app = app
        self.keys = {k.encode(): q for k, q in keys.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        counted = scope["type"] == "http" and scope["path"] not in UNCOUNTED_PATHS
        quota = self.keys.get(bearer_token(scope) or b"") if counted else None
        if quota is None:  # no key (the key check has decided), or a probe
            return await self.app(scope, receive, send)
        try:
            quota.admit(counts_request=scope["method"] == "POST")
        except APIError as e:
            headers = {**{k.decode(): v.decode() for k, v in quota.headers()}, **e.headers}
            return await JSONResponse(e.body(), status_code=e.status, headers=headers)(scope, receive, send)
        scope[SCOPE_KEY] = quota
        quota.in_flight += 1

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start":  # after the route charged its tokens
                message = {**message, "headers": [*message.get("headers", []), *quota.headers()]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_limits)
        finally:
            quota.in_flight -= 1
