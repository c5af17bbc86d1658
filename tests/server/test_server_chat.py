"""POST /v1/chat/completions through the official openai client."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def collect_stream(stream) -> tuple[dict[int, str], dict[int, str], list]:
    """Texts and finish reasons by choice index, and the chunks."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return texts, finish, chunks


@pytest.fixture(scope="module")
def greedy_reply(server, model_name):
    """The greedy 8-token reply to MESSAGES."""
    return server.client().chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=8, temperature=0
    )


def test_chat_completion(greedy_reply, model_name):
    out = greedy_reply
    assert out.model == model_name
    assert out.object == "chat.completion"
    message = out.choices[0].message
    assert message.role == "assistant" and "Paris" in message.content
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens > 10
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_max_completion_tokens_limits_the_reply(client, model_name):
    out = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_completion_tokens=3, temperature=0
    )
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_streamed_chat_equals_whole(client, model_name, greedy_reply):
    texts, finish, chunks = collect_stream(
        client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert texts == {0: greedy_reply.choices[0].message.content}
    assert finish == {0: greedy_reply.choices[0].finish_reason}
    assert chunks[-1].choices == [] and chunks[-1].usage == greedy_reply.usage


def test_n2_seeded_is_reproducible_streamed_or_not(client, model_name):
    kwargs = {
        "model": model_name,
        "messages": MESSAGES,
        "max_tokens": 5,
        "temperature": 1.0,
        "n": 2,
        "seed": 99,
    }
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.message.content for c in sorted(second.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]
    streamed, _, _ = collect_stream(client.chat.completions.create(stream=True, **kwargs))
    assert streamed == dict(enumerate(texts))


def test_logprobs_and_top_logprobs(client, model_name):
    out = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled one is the top
    assert "".join(e.token for e in content).startswith(out.choices[0].message.content[:5])


def test_streamed_logprobs(client, model_name):
    _, _, chunks = collect_stream(
        client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=1,
            stream=True,
        )
    )
    entries = [e for c in chunks[1:] for e in (c.choices[0].logprobs.content or [])]
    assert len(entries) == 4


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(client, model_name, greedy_reply, stream):
    greedy = greedy_reply.choices[0].message.content
    stop = greedy.split()[2]
    kwargs = {"model": model_name, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    kwargs["stop"] = stop
    if stream:
        texts, finish, _ = collect_stream(client.chat.completions.create(stream=True, **kwargs))
        text, reason = texts[0], finish[0]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        text, reason = choice.message.content, choice.finish_reason
    assert text == greedy[: greedy.index(stop)] and reason == "stop"


def test_multi_turn_and_content_parts(client, model_name):
    out = client.chat.completions.create(
        model=model_name,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Say hello."}]},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Again."},
        ],
        max_tokens=4,
        temperature=0,
    )
    assert out.usage.completion_tokens >= 1
