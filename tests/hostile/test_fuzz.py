"""Property-based fuzzing of the request bodies of every endpoint that reads one: whatever a
client with a valid API key sends, the answer is never a 5xx (nor a dropped connection, nor a
stream that ends in a server error), and the server is whole afterwards (conftest.py).

The figures (requests, status codes, seconds) are printed at the end of the module: run it with
``-s`` to read them.
"""

from __future__ import annotations

import collections
import time

import httpx
import pytest
from helpers.hostile_bodies import (
    chat_objects,
    completion_objects,
    detokenize_objects,
    request_bodies,
    tokenize_objects,
)
from hypothesis import HealthCheck, given, settings

pytestmark = pytest.mark.slow

# Examples per endpoint: generating ones cost a model step or three, the others milliseconds.
# The whole module stays well under a minute on two CPU cores.
ENDPOINTS = {
    "/v1/completions": (completion_objects, 120),
    "/v1/chat/completions": (chat_objects, 120),
    "/tokenize": (tokenize_objects, 80),
    "/detokenize": (detokenize_objects, 80),
}


class Tally:
    """Requests sent, by endpoint and status code, and the seconds they took."""

    def __init__(self) -> None:
        self.codes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.seconds = 0.0

    def add(self, path: str, status: int | str, seconds: float) -> None:
        self.codes[path][status] += 1
        self.seconds += seconds

    def report(self) -> str:
        total = collections.Counter()
        lines = []
        for path, codes in self.codes.items():
            total.update(codes)
            lines.append(f"  {path}: {sum(codes.values())} requests, {dict(sorted(codes.items()))}")
        failures = sum(n for code, n in total.items() if not isinstance(code, int) or code >= 500)
        codes = dict(sorted(total.items(), key=str))
        head = (
            f"fuzz: {sum(total.values())} requests in {self.seconds:.1f} s, "
            f"{failures} 5xx or dropped, status codes {codes}"
        )
        return "\n".join([head, *lines])


@pytest.fixture(scope="module")
def tally():
    tally = Tally()
    yield tally
    print("\n" + tally.report())


@pytest.mark.parametrize("path", ENDPOINTS)
def test_no_body_gets_a_server_error(path, http, tally):
    objects, examples = ENDPOINTS[path]

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,  # nothing written into the checkout; a failure prints its example
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(body=request_bodies(objects()))
    def post(body: bytes) -> None:
        started = time.perf_counter()
        try:
            reply = http.post(path, content=body, headers={"Content-Type": "application/json"})
        except httpx.TransportError as exc:  # the server dropped the connection
            tally.add(path, type(exc).__name__, time.perf_counter() - started)
            raise AssertionError(f"{path}: no answer to {body!r}: {exc!r}") from exc
        tally.add(path, reply.status_code, time.perf_counter() - started)
        assert reply.status_code < 500, f"{path} {body!r} -> {reply.status_code} {reply.text}"
        if reply.status_code >= 400:
            error = reply.json()["error"]  # OpenAI error JSON, whatever went wrong
            assert error["type"] != "server_error" and error["message"], reply.text
        # A stream that started well and then failed ends with an error event, not a 5xx.
        assert '"type":"server_error"' not in reply.text, f"{path} {body!r} -> {reply.text}"

    post()
