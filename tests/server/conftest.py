"""A real `ember serve` (front end + engine process, the embedded SmolLM2 on the CPU), started
once for the tests of this folder and shared by them."""

from __future__ import annotations

import httpx
import openai
import pytest

from .server_process import API_KEY, ServerProcess

# Sized for a 2-core CPU: a short context and a small KV pool load fast; 64 sequences per step
# let the concurrency test run in one batch.
SESSION_SERVER_FLAGS = (
    "--max-model-len",
    "1024",
    "--num-gpu-blocks-override",
    "400",
    "--max-num-seqs",
    "64",
    "--max-queue",
    "256",
    "--max-request-body-bytes",
    "65536",
    "--api-key",
    API_KEY,
    # SmolLM2's template shows no tool-call syntax: requests with tools are read as hermes.
    "--tool-call-parser",
    "hermes",
)


@pytest.fixture(scope="package")
def server():
    process = ServerProcess(*SESSION_SERVER_FLAGS).start()
    yield process
    try:
        process.terminate(timeout=60)
    finally:
        process.kill()


@pytest.fixture(scope="package")
def model_name(server) -> str:
    return server.client().models.list().data[0].id


@pytest.fixture
def client(server) -> openai.OpenAI:
    return server.client()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as http:
        yield http
