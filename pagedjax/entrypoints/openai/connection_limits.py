"""Connections that hold the server without sending a request: uvicorn's h11 protocol with a
deadline for reading each request and a cap on open connections.

uvicorn closes idle keep-alive connections, but nothing bounds a request that is still being
read: h11 has no header timeout, and a body is awaited for as long as its client likes. A client
that sends half a request and stops holds a connection (a socket, a file descriptor) until it
gives up. Here each request must arrive whole within `read_timeout` seconds of its first byte
(of the connection's start, for the first request): past that the server answers 408 (unless it
has answered already) and closes the connection. The deadline is for the whole request, not for
each read, so a client that drips a byte at a time cannot stretch it; it is a protocol-level
timer because an ASGI middleware only sees a request once its headers are in.

Past `max_connections` open connections a request is answered 503, in OpenAI's error shape, and
its connection closed. The count includes the connections still sending a request, so half-sent
requests can crowd out others for at most the read deadline. (uvicorn's own limit_concurrency
does this with a plain-text body.)

The subclass leans on uvicorn's H11Protocol internals (0.54: `conn`, `cycle`, `connections`):
`pagedjax serve` always runs it, whether or not httptools is installed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import resource
from typing import Any

import h11
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedjax.entrypoints.openai.errors import error_body


def guarded_h11(read_timeout: float, max_connections: int | None = None) -> Any:
    """The protocol factory for uvicorn.Config(http=...); max_connections None: the default."""
    return functools.partial(GuardedH11Protocol, read_timeout=read_timeout,
                             max_connections=max_connections or default_max_connections())


def default_max_connections() -> int:
    """4096, or fewer where the process may not open as many files (sockets among them)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 4096 if soft == resource.RLIM_INFINITY else max(16, min(4096, soft - 64))


class GuardedH11Protocol(H11Protocol):
    def __init__(self, *args: Any, read_timeout: float, max_connections: int,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeout, self.max_connections = read_timeout, max_connections
        self._read_deadline: asyncio.TimerHandle | None = None
        self.app = functools.partial(self._admit, self.app)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY or (state is h11.IDLE and self.conn.trailing_data[0]):
            if self._read_deadline is None:  # a request has begun: it has read_timeout s
                self._arm()
        elif state is not h11.IDLE:  # whole (or the connection is done)
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._read_deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        """408 (unless this request has its answer already) and close."""
        self._read_deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or not cycle.response_started or cycle.response_complete:
            self.transport.write(_timeout_response(
                f"The request did not arrive whole within {self.read_timeout:g} s (pagedjax "
                "serve --request-read-timeout); send it all at once."))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app reads a disconnect and sends no more
            cycle.message_event.set()
        self.transport.close()

    async def _admit(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        """The app, or a 503 when this connection is one too many."""
        num_open = len(self.connections)  # this one among them
        if num_open <= self.max_connections:
            await app(scope, receive, send)
            return
        body = error_body(503, f"The server has {num_open} connections open, over its limit of "
                               f"{self.max_connections} (pagedjax serve --max-connections); "
                               "retry shortly.", code="too_many_connections")
        await JSONResponse(body, status_code=503,
                           headers={"connection": "close", "retry-after": "1"})(
            scope, receive, send)


def _timeout_response(message: str) -> bytes:
    """A whole 408 that closes its connection, written past h11 (whose state machine has no
    request to answer when the headers never came whole)."""
    content = json.dumps(error_body(408, message, code="request_timeout")).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n" % len(content) + content)
