"""A streamed response whose client goes away aborts its requests at once, wherever Starlette's
cancellation lands: in the engine's wait, or in `send` between two of the body's items (where
Starlette leaves the body's generator suspended for the garbage collector). The server's own
path, under load, is tests/entrypoints/openai/test_load.py's dropped streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from pagedjax.entrypoints.openai.serving import OpenAIServing, event_stream

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
REQUEST_IDS = ["cmpl-0", "cmpl-1"]


class RecordingEngine:
    """The two abort calls abort_on_disconnect makes, recorded."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)


class Client:
    """An ASGI client that takes `chunks` body chunks, then disconnects; with `pause_in_send`,
    its send of the last chunk waits, so that the cancellation lands in `send` (else in the
    body's wait for the engine)."""

    def __init__(self, chunks: int, pause_in_send: bool) -> None:
        self.chunks, self.pause_in_send = chunks, pause_in_send
        self.gone = asyncio.Event()
        self.delivered = False
        self.bodies: list[bytes] = []

    async def receive(self) -> dict[str, Any]:
        """The disconnect, once: ASGI's receive is a queue of messages, and a server may deliver
        each once (uvicorn repeats it). Here Starlette's listener, which waits first, takes it,
        and abort_on_disconnect's watcher never sees it."""
        await self.gone.wait()
        if self.delivered:
            await asyncio.Event().wait()  # nothing more comes
        self.delivered = True
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] != "http.response.body":
            return
        self.bodies.append(message["body"])
        if len(self.bodies) == self.chunks:
            self.gone.set()
            if self.pause_in_send:
                await asyncio.sleep(0.2)


def serving_with(engine: RecordingEngine) -> OpenAIServing:
    serving = object.__new__(OpenAIServing)  # only abort_on_disconnect is used
    serving.engine = engine
    return serving


async def stream(serving: OpenAIServing, client: Client, items: int | None) -> list[str]:
    """Serve a response whose requests yield `items` events (None: until aborted), and return
    what was aborted when the response returned (no garbage collection in between: the body's
    generator is still referenced here)."""

    class Request:  # the raw request: its disconnect is the client's
        receive = client.receive

    async def events() -> AsyncIterator[str]:
        async with serving.abort_on_disconnect(Request(), REQUEST_IDS):
            i = 0
            while items is None or i < items:
                await asyncio.sleep(0.01)  # the engine's next output
                yield f"data: {i}\n\n"
                i += 1

    body = events()
    response = event_stream(body)
    await response(SCOPE, client.receive, client.send)
    aborted = list(serving.engine.aborted)
    assert body is not None and response is not None
    return aborted


@pytest.mark.parametrize("pause_in_send", [True, False], ids=["cancelled-in-send",
                                                              "cancelled-in-wait"])
def test_a_client_that_goes_away_aborts_the_requests_at_once(pause_in_send: bool) -> None:
    engine = RecordingEngine()
    aborted = asyncio.run(stream(serving_with(engine), Client(2, pause_in_send), None))
    assert sorted(set(aborted)) == REQUEST_IDS


def test_a_stream_that_ends_aborts_nothing() -> None:
    engine = RecordingEngine()
    client = Client(chunks=100, pause_in_send=False)
    aborted = asyncio.run(stream(serving_with(engine), client, items=3))
    assert aborted == []
    assert client.bodies == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
