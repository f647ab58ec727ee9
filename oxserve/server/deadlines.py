"""Read deadlines per connection: a client that dribbles its request cannot hold a connection.

uvicorn (h11) waits for a request's headers and body as long as the client likes: only an
idle connection between requests times out. Each connection here gets a deadline for the
next request's headers (from the moment the connection opens, or the last response ends)
and another for its body (from the end of its headers). A connection past its headers
deadline is closed; one past its body deadline gets a 408 in OpenAI's error shape and is
closed. A request whose body has arrived has no deadline: a long generation is not slow input.

Past `max_connections` open connections (or requests running) a new request gets a 503 in the
same error shape, with `Retry-After`, and its connection is closed (uvicorn's own limit
answers in plain text).
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from oxserve.server.protocol import APIError


def deadline_protocol(header_timeout: float, body_timeout: float, max_connections: int | None = None) -> type[H11Protocol]:
    """uvicorn's h11 protocol with these read deadlines (seconds) and connection limit, for
    `uvicorn.Config(http=...)` (without uvicorn's `limit_concurrency`)."""
    limits = {"header_timeout": header_timeout, "body_timeout": body_timeout, "max_connections": max_connections}
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), limits)


class DeadlineH11Protocol(H11Protocol):
    header_timeout = 10.0
    body_timeout = 60.0
    max_connections: int | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None
        self._app, self.app = self.app, self._app_within_limit
        self._follow()

    async def _app_within_limit(self, scope, receive, send) -> None:
        # This connection and this request's task are counted already.
        limit = self.max_connections
        if limit is None or scope["type"] != "http" or (len(self.connections) <= limit and len(self.tasks) <= limit):
            return await self._app(scope, receive, send)
        self.logger.warning("refusing a request: %d connections open, %d requests running (--max-connections %d)",
                            len(self.connections), len(self.tasks), limit)  # fmt: skip
        error = APIError(503, f"the server is at its connection limit ({limit}); retry later", "server_error", None,
                         "too_many_connections")  # fmt: skip
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"retry-after", b"1"), (b"connection", b"close")]  # fmt: skip
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._follow()  # a kept-alive connection now waits for its next request's headers

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def _follow(self) -> None:
        """Arms the deadline for what the connection now waits for from the client."""
        state = self.conn.their_state
        self._arm("headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None)

    def _arm(self, waiting_for: str | None) -> None:
        if waiting_for == self._waiting_for:
            return  # the same wait goes on: its deadline stands (a total, not per chunk)
        if self._deadline is not None:
            self._deadline.cancel()
        self._waiting_for, self._deadline = waiting_for, None
        if waiting_for is not None:
            timeout = self.header_timeout if waiting_for == "headers" else self.body_timeout
            self._deadline = self.loop.call_later(timeout, self._expired)

    def _expired(self) -> None:
        if self.transport.is_closing():
            return
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "unknown client"
        self.logger.warning("closing a connection whose request %s did not arrive in time (%s)", self._waiting_for, client)
        if self._waiting_for == "body" and self.cycle is not None and not self.cycle.response_started:
            timeout = self.body_timeout
            error = APIError(408, f"the request body did not arrive within {timeout:g} s", "invalid_request_error",
                             None, "request_timeout")  # fmt: skip
            self._send_and_close(408, json.dumps(error.body()).encode())
        self.transport.close()

    def _send_and_close(self, status: int, body: bytes) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=status, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # h11 cannot answer in this state: just close
            pass
        if self.cycle is not None:  # as if the client left: the app stops reading, its answer is dropped
            self.cycle.disconnected = True
            self.cycle.message_event.set()
