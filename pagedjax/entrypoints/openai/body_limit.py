"""A 413 for a request body over the server's limit, before the app parses it: at once when the
Content-Length header says so, else as soon as the bytes read pass the limit (a chunked body).
A huge prompt then costs neither the JSON parse nor the tokenization on the event loop."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedjax.entrypoints.openai.errors import error_body


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(int(declared), scope, receive, send)
            return
        received, refused = 0, False

        async def limited_receive() -> Message:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request" and not refused:
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    await self._refuse(None, scope, receive, send)
                    return {"type": "http.disconnect"}  # the app stops reading: it is answered
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)

    async def _refuse(self, size: int | None, scope: Scope, receive: Receive,
                      send: Send) -> None:
        """size: the declared Content-Length (None: a chunked body)."""
        what = f"is {size} bytes," if size is not None else "is"
        body = error_body(413, f"The request body {what} over this server's limit of "
                               f"{self.max_bytes} bytes (pagedjax serve --max-request-body-bytes); "
                               "send a shorter prompt.", code="request_too_large")
        response = JSONResponse(body, status_code=413, headers={"connection": "close"})
        await response(scope, receive, send)
