"""`--api-key` / `--api-keys`: every route needs `Authorization: Bearer <key>` but /health (and /metrics, unless
`--api-key-protects-metrics`). Default-deny, so a route added later is covered without a list to update."""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from oxserve.server.protocol import APIError

UNAUTHORIZED = APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                        "invalid_request_error", None, "invalid_api_key")  # fmt: skip


class RequireAPIKey:
    """ASGI middleware: answers 401 (OpenAI's error shape, `WWW-Authenticate: Bearer`) unless the
    request carries the key. A pure ASGI wrapper: it reads headers only, so bodies and SSE pass through."""

    def __init__(self, app: ASGIApp, api_keys: list[str], protect_metrics: bool = False):
        self.app = app
        self.keys = [k.encode() for k in api_keys]
        self.open_paths = {"/health"} if protect_metrics else {"/health", "/metrics"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Not http: lifespan (the server has no websocket routes).
        if scope["type"] != "http" or scope["path"] in self.open_paths or self._authorized(scope):
            return await self.app(scope, receive, send)
        response = JSONResponse(UNAUTHORIZED.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        token = bearer_token(scope)
        # compare_digest against every key: the time taken tells neither how much of a guessed
        # key was right nor which key it was near.
        return token is not None and sum(hmac.compare_digest(token, key) for key in self.keys) > 0


def bearer_token(scope: Scope) -> bytes | None:
    """The token of `Authorization: Bearer <token>`, or None."""
    value = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
    scheme, _, token = value.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None
