"""A real `ember serve` (front end + engine process, the embedded SmolLM2 on the CPU) for each
module of hostile requests, and after each module the proof that they left the server whole:
still running with its first engine and its first load of the model, still answering, no slot
of the waiting queue and no KV block held."""

from __future__ import annotations

import httpx
import pytest
from server.server_process import API_KEY, ServerProcess

MAX_QUEUE = 16
SERVER_FLAGS = (
    "--max-model-len",
    "512",
    "--num-gpu-blocks-override",
    "128",
    "--max-num-seqs",
    "16",
    "--max-queue",
    str(MAX_QUEUE),
    "--max-request-body-bytes",
    "65536",
    "--api-key",
    API_KEY,
    # A lost engine ends the server instead of being replaced: no crash can go unseen.
    "--max-engine-restarts",
    "0",
)


@pytest.fixture(scope="module")
def server():
    process = ServerProcess(*SERVER_FLAGS).start()
    yield process
    try:
        process.terminate(timeout=60)
    finally:
        process.kill()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as http:
        yield http


@pytest.fixture(scope="module")
def model_name(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module", autouse=True)
def server_left_whole(server, http, model_name):
    yield
    assert_server_whole(server, http, model_name)


def assert_server_whole(server: ServerProcess, http: httpx.Client, model_name: str) -> None:
    assert server.process.poll() is None, f"the server exited:\n{server.log()}"
    normal = {"model": model_name, "prompt": "Hi", "max_tokens": 2, "ignore_eos": True}
    reply = http.post("/v1/completions", json={**normal, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2
    # Every slot of the waiting queue is free: one request of MAX_QUEUE sequences fits (a
    # slot leaked by an earlier request would make it a 429).
    reply = http.post("/v1/completions", json={**normal, "max_tokens": 1, "n": MAX_QUEUE})
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == MAX_QUEUE
    for name in (
        "ember:kv_cache_blocks_used",
        "ember:num_requests_running",
        "ember:num_requests_waiting",
    ):
        assert server.wait_for_metric(name, 0) == 0, name
    # The model was loaded once: no step failed (a failed step unloads the model, and its next
    # request loads it again).
    loads = [
        value
        for key, value in server.metrics().items()
        if key.startswith("ember:model_transitions_total{") and 'action="load"' in key
    ]
    assert loads == [1.0]
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log, server.log()
