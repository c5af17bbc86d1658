"""Many streams at once: each gets the text it would get alone, and cancelled ones free their
KV blocks at once."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colors are",
]
MAX_TOKENS = 16


async def stream_completion(client, model, prompt: str, max_tokens: int) -> str:
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])


def test_64_concurrent_greedy_streams_match_lone_requests(server, client, model_name):
    alone = {
        p: client.completions.create(
            model=model_name, prompt=p, max_tokens=MAX_TOKENS, temperature=0
        )
        .choices[0]
        .text
        for p in PROMPTS
    }

    async def run_all() -> list[str]:
        async with server.async_client(timeout=300) as aclient:
            jobs = [
                stream_completion(aclient, model_name, PROMPTS[i % len(PROMPTS)], MAX_TOKENS)
                for i in range(64)
            ]
            return await asyncio.gather(*jobs)

    texts = asyncio.run(run_all())
    for i, text in enumerate(texts):
        assert text == alone[PROMPTS[i % len(PROMPTS)]], i


def test_cancelled_streams_free_every_kv_block(server, client, model_name):
    async def start_and_cancel(aclient, prompt: str) -> int:
        stream = await aclient.completions.create(
            model=model_name,
            prompt=prompt,
            max_tokens=200,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        received = 0
        async for chunk in stream:
            received += 1
            if received == 3:
                break
        await stream.close()
        return received

    async def run_all() -> list[int]:
        async with server.async_client(timeout=300) as aclient:
            jobs = [start_and_cancel(aclient, PROMPTS[i % len(PROMPTS)]) for i in range(50)]
            return await asyncio.gather(*jobs)

    assert asyncio.run(run_all()) == [3] * 50
    assert server.wait_for_metric("ember:kv_cache_blocks_used", 0) == 0
    assert server.wait_for_metric("ember:num_requests_running", 0) == 0
    assert server.metric("ember:kv_cache_usage_perc") == 0
    # The engine did not generate the 200 tokens of each cancelled stream.
    out = client.completions.create(model=model_name, prompt="Hi", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3


def test_non_streamed_request_is_aborted_when_the_client_leaves(server, model_name):
    import httpx

    body = {
        "model": model_name,
        "prompt": "Once upon a time",
        "max_tokens": 500,
        "ignore_eos": True,
        "temperature": 0,
    }
    with httpx.Client(base_url=server.base_url, headers=server.headers) as http:
        try:
            http.post("/v1/completions", json=body, timeout=1.5)
        except httpx.TimeoutException:
            pass  # we hung up after 1.5 s, long before 500 tokens
    assert server.wait_for_metric("ember:kv_cache_blocks_used", 0) == 0
    assert server.wait_for_metric("ember:num_requests_running", 0) == 0
