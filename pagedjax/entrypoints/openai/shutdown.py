"""A bounded, clean shutdown on SIGTERM or SIGINT.

uvicorn, told to stop, waits for every open connection without limit (a client that stops
reading a stream holds it forever), then raises the signal again, so the process dies of it
before `engine.shutdown()` and the atexit hooks run. DrainingServer instead:

1. stops accepting, closes idle connections, lets open requests run on for `shutdown_timeout`
   seconds;
2. then answers what is still open (OpenResponses, an ASGI middleware that sees every response
   go out): a stream ends with an error event in OpenAI's shape and `data: [DONE]`, a request
   not answered yet gets a 503; the app's later messages are dropped, and as its response is
   complete the app reads a disconnect, which aborts the generation;
3. a second later aborts the connections whose clients read nothing (their sends cannot
   finish), cancels what is left, and returns without raising the signal again: the caller
   shuts the engine down and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedjax.entrypoints.openai.errors import error_body
from pagedjax.entrypoints.openai.serving import SSE_DONE, sse

logger = logging.getLogger("pagedjax")

END_GRACE_S = 1.0  # for the final events to go out, before connections are aborted
SHUTTING_DOWN = "the server is shutting down; retry the request."


class _Exchange:
    """One request's response, as the app sends it."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.lock = asyncio.Lock()  # the app's sends and end() one at a time
        self.started = self.streaming = self.ended = False

    async def forward(self, message: Message) -> None:
        async with self.lock:
            if self.ended:
                return
            if message["type"] == "http.response.start":
                self.started = True
                content_type = dict(message.get("headers", ())).get(b"content-type", b"")
                self.streaming = content_type.startswith(b"text/event-stream")
            await self.send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                self.ended = True

    async def end(self, scope: Scope, receive: Receive) -> None:
        """Finish the response now: an error event and [DONE], or a 503."""
        async with self.lock:
            if self.ended:
                return
            self.ended = True
            if not self.started:
                await JSONResponse(error_body(503, SHUTTING_DOWN), status_code=503,
                                   headers={"connection": "close"})(scope, receive, self.send)
            elif self.streaming:
                body = (sse(error_body(503, SHUTTING_DOWN)) + SSE_DONE).encode()
                await self.send({"type": "http.response.body", "body": body,
                                 "more_body": False})


class OpenResponses:
    """The responses in progress, so that a shutdown can end them: the ASGI middleware
    `app.add_middleware(open_responses.middleware)` tracks them."""

    def __init__(self) -> None:
        self._open: dict[_Exchange, tuple[Scope, Receive]] = {}

    def middleware(self, app: ASGIApp) -> ASGIApp:
        async def track(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            exchange = _Exchange(send)
            self._open[exchange] = (scope, receive)
            try:
                await app(scope, receive, exchange.forward)
            finally:
                self._open.pop(exchange, None)

        return track

    def __len__(self) -> int:
        return sum(not exchange.ended for exchange in self._open)

    async def end_all(self, timeout: float) -> int:
        """End every open response within timeout seconds; how many could not be (their
        clients read nothing)."""
        ends = [asyncio.ensure_future(exchange.end(*where))
                for exchange, where in list(self._open.items()) if not exchange.ended]
        if not ends:
            return 0
        _, pending = await asyncio.wait(ends, timeout=timeout)
        for future in pending:
            future.cancel()
        return len(pending)


class DrainingServer(uvicorn.Server):
    """uvicorn's Server with the shutdown of the module docstring."""

    def __init__(self, config: uvicorn.Config, responses: OpenResponses,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.responses, self.shutdown_timeout = responses, shutdown_timeout

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, less raising the signal again at the end."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            logger.info("%s: finishing the requests in flight (up to %g s, "
                        "--shutdown-timeout), then stopping", signal.Signals(sig).name,
                        self.shutdown_timeout)
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        connections = self.server_state.connections
        for connection in list(connections):
            connection.shutdown()  # idle ones close; busy ones close after their response
        if not await self._wait(lambda: not connections, self.shutdown_timeout):
            logger.warning("%d request(s) still open after %g s: ending them with an error",
                           len(self.responses), self.shutdown_timeout)
            stuck = await self.responses.end_all(END_GRACE_S)
            if not await self._wait(lambda: len(connections) <= stuck, END_GRACE_S) or stuck:
                logger.warning("closing %d connection(s) (%d not reading their response)",
                               len(connections), stuck)
                for connection in list(connections):
                    connection.transport.abort()
        tasks = self.server_state.tasks  # their connections are closed: they end soon
        if not await self._wait(lambda: not tasks, END_GRACE_S):
            for task in list(tasks):
                task.cancel()
            await self._wait(lambda: not tasks, END_GRACE_S)
        if not self.force_exit:
            await self.lifespan.shutdown()

    async def _wait(self, done: Callable[[], bool], timeout: float) -> bool:
        """Wait until done() (True) or timeout seconds pass (False); a forced exit (a second
        SIGINT) stops waiting."""
        deadline = time.monotonic() + timeout
        while not done():
            if self.force_exit or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True
