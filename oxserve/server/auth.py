"""`--api-key`: every route needs `Authorization: Bearer <key>` but /health (and /metrics, unless
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

    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool = False):
        self.app = app
        self.key = api_key.encode()
        self.open_paths = {"/health"} if protect_metrics else {"/health", "/metrics"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Not http: lifespan (the server has no websocket routes).
        if scope["type"] != "http" or scope["path"] in self.open_paths or self._authorized(scope):
            return await self.app(scope, receive, send)
        response = JSONResponse(UNAUTHORIZED.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        value = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = value.partition(b" ")
        # compare_digest: the time taken does not tell how much of a guessed key was right.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
