"""The event stream of a streamed completion, on a fake ASGI server: what reaches the socket,
how errors and disconnects end it, and that the engine requests are freed however it ends."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from ember.server.errors import BadRequestError
from ember.server.sse import SERVER_SEND, ChunkEncoder, EventStreamResponse, sse_event


class FakeServer:
    """An ASGI server's side of one request: records what is sent, disconnects on demand."""

    def __init__(self) -> None:
        self.wrapped: list[dict] = []  # through the app's middlewares
        self.direct: list[dict] = []  # to the server's own send
        self.disconnected = asyncio.Event()

    async def send_wrapped(self, message: dict) -> None:
        self.wrapped.append(message)

    async def send_direct(self, message: dict) -> None:
        self.direct.append(message)

    async def receive(self) -> dict:
        await self.disconnected.wait()
        return {"type": "http.disconnect"}

    def scope(self) -> dict:
        return {"type": "http", SERVER_SEND: self.send_direct}

    def body(self) -> bytes:
        return b"".join(m["body"] for m in self.direct)


def events_of(body: bytes) -> list[str]:
    assert body.endswith(b"\n\n")
    return [event.removeprefix(b"data: ").decode() for event in body.split(b"\n\n")[:-1]]


async def serve(events, server: FakeServer, cleanups: list[str]) -> None:
    response = EventStreamResponse(events, lambda: cleanups.append("cleanup"))
    await response(server.scope(), server.receive, server.send_wrapped)


def test_events_then_done_with_the_body_sent_past_the_middlewares():
    async def events():
        yield sse_event({"n": 1})
        yield sse_event({"n": 2}) + sse_event({"n": 3})

    server, cleanups = FakeServer(), []
    asyncio.run(serve(events(), server, cleanups))
    # Only the start passes the middlewares (they watch for it); the body goes to the server.
    assert [m["type"] for m in server.wrapped] == ["http.response.start"]
    assert server.wrapped[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in server.wrapped[0]["headers"]
    assert all(m["type"] == "http.response.body" for m in server.direct)
    assert [m["more_body"] for m in server.direct] == [True, True, False]
    assert events_of(server.body()) == ['{"n":1}', '{"n":2}', '{"n":3}', "[DONE]"]
    assert cleanups == ["cleanup"]


def test_without_the_server_send_in_the_scope_everything_goes_through_send():
    async def events():
        yield sse_event({"n": 1})

    server, cleanups = FakeServer(), []
    response = EventStreamResponse(events(), lambda: cleanups.append("cleanup"))
    asyncio.run(response({"type": "http"}, server.receive, server.send_wrapped))
    body = b"".join(m.get("body", b"") for m in server.wrapped)
    assert events_of(body) == ['{"n":1}', "[DONE]"]
    assert cleanups == ["cleanup"]


@pytest.mark.parametrize(
    ("error", "expected_type"),
    [
        (BadRequestError("the engine rejected it"), "invalid_request_error"),
        (RuntimeError("boom"), "server_error"),
    ],
)
def test_an_error_mid_stream_is_one_error_event_before_done(error, expected_type):
    async def events():
        yield sse_event({"n": 1})
        raise error

    server, cleanups = FakeServer(), []
    asyncio.run(serve(events(), server, cleanups))
    first, failure, done = events_of(server.body())
    assert json.loads(first) == {"n": 1}
    assert json.loads(failure)["error"]["type"] == expected_type
    assert done == "[DONE]"
    assert server.direct[-1]["more_body"] is False
    assert cleanups == ["cleanup"]


def test_a_disconnect_stops_the_stream_and_frees_the_requests():
    closed = []

    async def events():
        try:
            yield sse_event({"n": 1})
            await asyncio.Event().wait()  # the engine never answers
            yield sse_event({"n": 2})
        finally:
            closed.append(True)

    async def run(server: FakeServer, cleanups: list[str]) -> None:
        serving = asyncio.create_task(serve(events(), server, cleanups))
        while not server.direct:
            await asyncio.sleep(0)
        server.disconnected.set()
        await asyncio.wait_for(serving, 5)

    server, cleanups = FakeServer(), []
    asyncio.run(run(server, cleanups))
    assert events_of(server.body()) == ['{"n":1}']
    assert closed == [True]
    assert cleanups == ["cleanup"]


def test_a_disconnect_before_the_first_event_still_frees_the_requests():
    async def events():
        await asyncio.Event().wait()
        yield b""

    server, cleanups = FakeServer(), []
    server.disconnected.set()
    asyncio.run(asyncio.wait_for(serve(events(), server, cleanups), 5))
    assert cleanups == ["cleanup"]


@pytest.mark.parametrize("usage", [False, True])
def test_chunk_encoder_writes_what_the_whole_chunk_encodes_to(usage):
    header = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    if usage:
        header["usage"] = None
    choice = {
        "index": 3,
        "text": 'a "quoted"\nline é',
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
    }
    event = ChunkEncoder(header).event(choice)
    assert event == sse_event({**header, "choices": [choice]})
    assert msgspec.json.decode(event.removeprefix(b"data: ")) == {**header, "choices": [choice]}
