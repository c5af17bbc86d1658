"""Short-lived servers for what ends a server, or nearly: a full queue (429), SIGTERM (drain,
abort what outlives the timeout, then exit), and a lost engine process (its requests fail at
once, new ones get 503 with Retry-After, a new engine serves; too many losses end the server)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from .server_process import ServerProcess

pytestmark = pytest.mark.slow

# One sequence at a time and two may wait: the queue is easy to fill.
SMALL_SERVER_FLAGS = (
    "--max-model-len",
    "512",
    "--num-gpu-blocks-override",
    "64",
    "--max-num-seqs",
    "1",
    "--max-queue",
    "2",
    "--shutdown-timeout",
    "60",
)

LONG = {"max_tokens": 400, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def small_server():
    process = ServerProcess(*SMALL_SERVER_FLAGS, api_key=None).start()
    yield process
    process.kill()


def engine_process(server: ServerProcess) -> psutil.Process:
    """The engine: the front end's child started by multiprocessing's spawn."""
    children = psutil.Process(server.process.pid).children()
    (engine,) = [p for p in children if "spawn_main" in " ".join(p.cmdline())]
    return engine


def first_chunk_of_stream(client, model: str, **kwargs):
    stream = client.completions.create(
        model=model, prompt="Once upon a time", stream=True, **kwargs
    )
    return stream, next(iter(stream))


def test_full_queue_is_429_with_retry_after(small_server):
    client = small_server.client()
    model = client.models.list().data[0].id
    running, _ = first_chunk_of_stream(client, model, **LONG)
    waiting = [
        client.completions.create(model=model, prompt="Hi", stream=True, **LONG) for _ in range(2)
    ]
    reply = httpx.post(
        small_server.base_url + "/v1/completions", json={"model": model, "prompt": "Hi"}
    )
    assert reply.status_code == 429
    assert reply.headers["retry-after"] == "1"
    assert reply.json()["error"]["type"] == "rate_limit_error"
    for stream in (running, *waiting):
        stream.close()
    deadline = time.monotonic() + 20
    while small_server.metric("ember:kv_cache_blocks_used") and time.monotonic() < deadline:
        time.sleep(0.1)
    out = client.completions.create(model=model, prompt="Hi", max_tokens=2)
    assert out.usage.completion_tokens == 2


def test_sigterm_drains_running_requests_then_exits(small_server):
    client = small_server.client()
    model = client.models.list().data[0].id
    engine = engine_process(small_server)
    result = {}

    def finish_stream(stream, first_chunk):
        chunks = [first_chunk, *stream]
        result["usage"] = chunks[-1].usage
        result["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices][-1]

    stream, first = first_chunk_of_stream(
        client,
        model,
        max_tokens=12,
        temperature=0,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    reader = threading.Thread(target=finish_stream, args=(stream, first))
    reader.start()
    os.kill(small_server.process.pid, signal.SIGTERM)
    # New requests are refused with 503 while the running one finishes.
    deadline = time.monotonic() + 10
    while True:
        reply = httpx.post(
            small_server.base_url + "/v1/completions",
            json={"model": model, "prompt": "Hi", "max_tokens": 2},
        )
        if reply.status_code == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "shutting_down"
    assert httpx.get(small_server.base_url + "/health").status_code == 503
    reader.join(timeout=60)
    assert result["finish"] == "length" and result["usage"].completion_tokens == 12
    assert small_server.process.wait(timeout=60) == 0
    engine.wait(timeout=30)
    assert not engine.is_running()


def test_a_lost_engine_fails_its_requests_fast_and_a_new_one_serves():
    server = ServerProcess(*SMALL_SERVER_FLAGS, api_key=None).launch()
    try:
        # While the engine loads (seconds: it imports torch first), the HTTP server already
        # answers, with 503.
        assert server.wait_for(lambda status: status in (200, 503), "listening") == 503
        reply = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi"})
        if reply.status_code == 503:  # (unless loading finished in between)
            assert reply.json()["error"]["code"] == "loading"
            assert reply.headers["Retry-After"]
        server.wait_for(lambda status: status == 200, "healthy")
        first_engine = engine_process(server)
        body = {"prompt": "Once upon a time", "stream": True, "max_tokens": 400, "ignore_eos": True}
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")  # generating
            first_engine.send_signal(signal.SIGKILL)
            # The stream in flight ends with an error event, then [DONE], instead of hanging.
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "engine_unavailable" and "engine" in error["message"]
        # Until a new engine has loaded: /health 503, requests 503 at once with Retry-After.
        health = httpx.get(server.base_url + "/health")
        assert health.status_code == 503
        start = time.monotonic()
        reply = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi"})
        assert reply.status_code == 503 and time.monotonic() - start < 2
        assert reply.json()["error"]["code"] in ("engine_unavailable", "loading")
        assert int(reply.headers["Retry-After"]) > 0
        lost_at = time.monotonic()
        server.wait_for(lambda status: status == 200, "healthy again")
        recovered_s = time.monotonic() - lost_at
        second_engine = engine_process(server)
        assert second_engine.pid != first_engine.pid
        reply = httpx.post(
            server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}
        )
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        print(f"a new engine served {recovered_s:.1f} s after the loss")
    finally:
        server.kill()


def test_engine_lost_more_often_than_allowed_ends_the_server_non_zero():
    server = ServerProcess(*SMALL_SERVER_FLAGS, "--max-engine-restarts", "1", api_key=None).start()
    try:
        engine_process(server).send_signal(signal.SIGKILL)  # the one restart allowed
        server.wait_for(lambda status: status == 503, "engine lost")
        server.wait_for(lambda status: status == 200, "healthy again")
        engine_process(server).send_signal(signal.SIGKILL)  # one loss too many
        assert server.process.wait(timeout=60) == 1
        assert "lost 2 times" in server.log()
    finally:
        server.kill()


def test_requests_still_running_at_the_drain_timeout_end_with_an_error_event():
    server = ServerProcess(*SMALL_SERVER_FLAGS[:-2], "--shutdown-timeout", "1", api_key=None)
    server.start()
    try:
        body = {"prompt": "Once upon a time", "stream": True, "max_tokens": 400, "ignore_eos": True}
        with httpx.stream(
            "POST", server.base_url + "/v1/completions", json=body, timeout=60
        ) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")
            signalled = time.monotonic()
            os.kill(server.process.pid, signal.SIGTERM)
            events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert "shutting down" in error["message"]
        assert server.process.wait(timeout=30) == 0
        assert time.monotonic() - signalled < 1 + 10  # the timeout plus a small bound
    finally:
        server.kill()
