"""A small asynchronous OpenAI-API client for load generation: one streamed request at a time per
call, timed chunk by chunk, plus the server's /tokenize and /v1/models helpers."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from ember.bench.datasets import SampledRequest

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}

# `RequestResult.error` of a request the client hung up on by design.
DROPPED = "dropped by the client"
# A benchmark request may legitimately stream for many minutes under heavy load.
_REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=6 * 3600)


@dataclass
class RequestResult:
    """What one streamed request did, in `time.perf_counter()` seconds."""

    success: bool
    prompt_len: int
    start_s: float
    output_tokens: int = 0
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunk_times_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for fewer than two tokens."""
        if not self.success or self.output_tokens < 2 or self.ttft_s is None:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


def chunk_text(chunk: dict) -> str:
    """The generated text a completions or chat-completions chunk carries ("" if none)."""
    text = ""
    for choice in chunk.get("choices") or ():
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


class OpenAIStreamClient:
    """Sends benchmark requests to one OpenAI-compatible endpoint with `stream=True`.

    TTFT is the arrival of the first chunk with text, ITL the gaps between such chunks, and the
    output token count the server's final usage report (the number of text chunks otherwise).
    """

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, endpoint: str):
        self.session = session
        self.url = base_url.rstrip("/") + ENDPOINT_PATHS[endpoint]
        self.model = model
        self.endpoint = endpoint

    def payload(self, request: SampledRequest, max_tokens: int | None = None) -> dict:
        """The JSON body: greedy, exactly `output_len` tokens (ignore_eos), usage in the stream."""
        body = {
            "model": self.model,
            "max_tokens": max_tokens or request.output_len,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        return body

    async def send(
        self,
        request: SampledRequest,
        max_tokens: int | None = None,
        drop_after_chunks: int | None = None,
    ) -> RequestResult:
        """Send one request and time its stream; errors are recorded, never raised. With
        ``drop_after_chunks``, hang up once that many text chunks have come (a client that goes
        away mid-stream: `error` says so)."""
        result = RequestResult(False, request.prompt_len, start_s=time.perf_counter())

        def on_text(text: str) -> bool:  # True: hang up now
            return drop_after_chunks is not None and (
                len(result.chunk_times_s) >= drop_after_chunks
            )

        body = self.payload(request, max_tokens)
        usage_tokens, hung_up = await post_stream(self.session, self.url, body, result, on_text)
        if hung_up:
            result.error = DROPPED
        return result if result.error else finished_result(result, usage_tokens)


async def post_stream(
    session: aiohttp.ClientSession,
    url: str,
    body: dict,
    result: RequestResult,
    on_text: Callable[[str], bool],
) -> tuple[int | None, bool]:
    """POST a streamed OpenAI request and read its SSE events into ``result`` (each text
    chunk's arrival time, the prompt length the usage reports, or the error: never raised),
    calling ``on_text`` with each chunk's text after its time is recorded; when it returns
    True the connection is dropped unread. Returns the completion tokens the usage reported
    (None if it did not) and whether ``on_text`` hung up."""
    usage_tokens = None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return None, False
            async for line in resp.content:
                now = time.perf_counter()
                if not line.startswith(b"data:"):
                    continue  # blank separators and SSE comments
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:300]
                    return None, False
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                    result.prompt_len = chunk["usage"].get("prompt_tokens") or result.prompt_len
                if text := chunk_text(chunk):
                    result.chunk_times_s.append(now)
                    if on_text(text):
                        resp.close()  # the connection goes, unread
                        return usage_tokens, True
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    return usage_tokens, False


def finished_result(result: RequestResult, usage_tokens: int | None) -> RequestResult:
    """Derive the latency figures from the recorded chunk arrival times."""
    times = result.chunk_times_s
    if not times:
        result.error = "stream ended without generated text"
        return result
    result.success = True
    result.output_tokens = usage_tokens if usage_tokens is not None else len(times)
    result.ttft_s = times[0] - result.start_s
    result.e2el_s = times[-1] - result.start_s
    result.itl_s = [later - earlier for earlier, later in itertools.pairwise(times)]
    return result


async def fetch_model_ids(base_url: str) -> list[str]:
    """The model names the server lists at GET /v1/models."""
    timeout = aiohttp.ClientTimeout(total=60)
    url = base_url.rstrip("/") + "/v1/models"
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as resp:
        resp.raise_for_status()
        body = await resp.json()
    return [entry["id"] for entry in body.get("data", [])]


class ServerTokenCounter:
    """Counts tokens with the server's own tokenizer through `POST /tokenize`.

    Used for sampling when no local tokenizer is given, so the lengths match what the server
    sees. Synchronous on the outside: sampling happens before the load test's event loop starts.
    """

    def __init__(self, base_url: str, model: str, parallel_requests: int = 32):
        self.url = base_url.rstrip("/") + "/tokenize"
        self.model = model
        self.parallel_requests = parallel_requests

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Token count of each text, asked for `parallel_requests` at a time."""
        return asyncio.run(self._count_all(list(texts)))

    async def _count_all(self, texts: list[str]) -> list[int]:
        gate = asyncio.Semaphore(self.parallel_requests)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:

            async def count_one(text: str) -> int:
                async with gate:
                    body = {"model": self.model, "prompt": text}
                    async with session.post(self.url, json=body) as resp:
                        resp.raise_for_status()
                        reply = await resp.json()
                return reply["count"] if "count" in reply else len(reply["tokens"])

            return list(await asyncio.gather(*(count_one(t) for t in texts)))
