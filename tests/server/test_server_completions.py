"""POST /v1/completions through the official openai client: whole and streamed, n, stop strings,
seeds, logprobs, echo, usage and every prompt shape. Token counts are small: the CPU is slow."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def stream_text(stream) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return texts


@pytest.fixture(scope="module")
def greedy_text(server, model_name) -> str:
    """The greedy 8-token completion of PROMPT."""
    out = server.client().completions.create(
        model=model_name, prompt=PROMPT, max_tokens=8, temperature=0
    )
    return out.choices[0].text


def test_greedy_completion_with_usage(client, model_name, greedy_text):
    out = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.model == model_name
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.text == greedy_text and "Paris" in choice.text
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens == 5
    assert out.usage.total_tokens == 13


def test_streamed_text_equals_whole_text(client, model_name, greedy_text):
    stream = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=8, temperature=0, stream=True
    )
    assert stream_text(stream) == {0: greedy_text}


def test_stream_include_usage_ends_with_a_usage_chunk(client, model_name):
    chunks = list(
        client.completions.create(
            model=model_name,
            prompt=PROMPT,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.prompt_tokens == 5
    assert chunks[-2].choices[0].finish_reason == "length"


def test_n2_seeded_choices_differ_and_reproduce(client, model_name):
    kwargs = {"model": model_name, "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0}
    first = client.completions.create(n=2, seed=1234, **kwargs)
    second = client.completions.create(n=2, seed=1234, **kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(second.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]  # choice i uses seed + i
    assert first.usage.completion_tokens == 12 and first.usage.prompt_tokens == 5
    streamed = stream_text(client.completions.create(n=2, seed=1234, stream=True, **kwargs))
    assert streamed == dict(enumerate(texts))


def test_unseeded_choices_differ(client, model_name):
    out = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=6, temperature=1.5, n=3
    )
    assert len({c.text for c in out.choices}) > 1


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(client, model_name, greedy_text, stream):
    stop = greedy_text.strip().split()[1]  # a word in the middle of the greedy text
    kwargs = {"model": model_name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    kwargs["stop"] = [stop, "never appears"]
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, finish = choice.text, choice.finish_reason
    assert text == greedy_text[: greedy_text.index(stop)]
    assert finish == "stop"


def test_logprobs_shape(client, model_name):
    out = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0
        assert 3 <= len(top) <= 4 and token in top
        assert top[token] == pytest.approx(max(top.values()))  # greedy picks the top token


def test_echo_prepends_the_prompt(client, model_name):
    out = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    choice = out.choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    assert choice.logprobs.token_logprobs[0] is None  # prompt tokens carry no logprob
    assert len(choice.logprobs.tokens) == 5 + 3


def test_prompt_shapes(client, model_name, http):
    ids = http.post("/tokenize", json={"model": model_name, "prompt": PROMPT}).json()["tokens"]
    greedy = {"model": model_name, "max_tokens": 4, "temperature": 0}
    by_text = client.completions.create(prompt=PROMPT, **greedy).choices[0].text
    by_ids = client.completions.create(prompt=ids, **greedy).choices[0].text
    assert by_ids == by_text
    batch = client.completions.create(prompt=[PROMPT, "1, 2, 3,"], **greedy)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text
    id_batch = client.completions.create(prompt=[ids, ids], **greedy)
    assert [c.text for c in id_batch.choices] == [by_text, by_text]
    assert id_batch.usage.prompt_tokens == 2 * len(ids)


def test_sampling_parameters_are_accepted(client, model_name):
    out = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"12": -100},
        seed=3,
        user="someone",
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "stop_token_ids": [2],
            "an_unknown_field": 1,
        },
    )
    assert 2 <= out.usage.completion_tokens <= 4  # min_tokens=2; token 2 may end it after


def test_ignore_eos_reaches_the_engine(client, model_name):
    messages = [{"role": "user", "content": "Reply with one word: yes or no?"}]
    natural = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=6, temperature=0
    )
    assert natural.choices[0].finish_reason == "stop"  # the model ends its short reply
    forced = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=natural.usage.completion_tokens + 2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].finish_reason == "length"
