"""/v1/chat/completions for a model that thinks between `<think>` and `</think>`
(--reasoning-parser qwen3 or deepseek_r1), through the real route over a scripted engine and a
tokenizer with Qwen3's tags: the block comes back as `reasoning_content`, the rest as
`content` or `tool_calls`, whole and streamed; `enable_thinking: false` reaches the template;
a response_format or a demanded call holds only the answer after the reasoning (the engine
stand-in writes the reasoning, then whatever the grammar allows)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers.grammar_writer import GrammarWriter
from helpers.think import think_template, think_tokenizer

from ember.structured_output.compiler import GrammarCompiler

from ..tool_calls.fake_server import GrammarEngine, chat_client

USER = [{"role": "user", "content": "Capital of France, as JSON?"}]
REPLY = "<think>\nThe user wants {JSON}.\nParis it is.\n</think>\n\nParis."
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"enum": [1, 2]}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}
FIND = {"type": "function", "function": {"name": "find", "parameters": CITY}}


def think_client(reply: str, parser: str | None = "qwen3", opens: bool = False, grammar=False):
    """A Qwen3-like model writing ``reply``; ``grammar``: under the request's grammar."""
    tokenizer = think_tokenizer(think_template(opens))
    ids = tokenizer.encode(reply, add_special_tokens=False)
    engine = None
    if grammar:
        eos = (tokenizer.added_token_id("<|im_end|>"),)
        writer = GrammarWriter(GrammarCompiler(tokenizer, tokenizer.vocab_size, eos), eos)
        engine = GrammarEngine(ids, writer)
    client, _, engine = chat_client(
        "", ids, reasoning_parser=parser, tokenizer=tokenizer, engine=engine
    )
    return client, tokenizer, engine


def post(client, messages=USER, **body):
    return client.post("/v1/chat/completions", json={"messages": messages, **body})


def message_of(response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


def streamed(response) -> tuple[dict[int, dict[str, str]], list[dict]]:
    """Each choice's joined reasoning and content, and every chunk."""
    assert response.status_code == 200, response.text
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    joined: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            parts = joined.setdefault(choice["index"], {"reasoning_content": "", "content": ""})
            for key in parts:
                parts[key] += choice["delta"].get(key) or ""
    return joined, chunks


def test_the_block_is_reasoning_and_the_rest_content():
    client, _, engine = think_client(REPLY)
    assert message_of(post(client)) == {
        "role": "assistant",
        "content": "Paris.",
        "reasoning_content": "The user wants {JSON}.\nParis it is.",
    }
    assert engine.params[0].structured_outputs is None


@pytest.mark.parametrize("chunk", [1, 4])
def test_streamed_reasoning_and_content(chunk):
    client, _, engine = think_client(REPLY)
    engine.chunk = chunk
    joined, chunks = streamed(post(client, stream=True, n=2))
    for index in (0, 1):
        assert joined[index] == {
            "reasoning_content": "The user wants {JSON}.\nParis it is.",
            "content": "Paris.",
        }
    assert not any("think>" in json.dumps(c) for c in chunks)


def test_without_a_reasoning_parser_the_block_stays_in_the_content():
    client, _, _ = think_client(REPLY, parser=None)
    message = message_of(post(client))
    assert message["content"] == REPLY and "reasoning_content" not in message


def test_enable_thinking_false_reaches_the_template_and_the_reply_is_content():
    client, tokenizer, engine = think_client("Paris.")
    message = message_of(post(client, chat_template_kwargs={"enable_thinking": False}))
    assert message == {"role": "assistant", "content": "Paris.", "reasoning_content": None}
    prompt = tokenizer.decode(engine.prompts[0], skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_template_that_opens_the_block_gives_reasoning_until_the_close(parser):
    client, _, _ = think_client("Hmm, Paris.\n</think>\n\nParis.", parser=parser, opens=True)
    message = message_of(post(client))
    assert (message["reasoning_content"], message["content"]) == ("Hmm, Paris.", "Paris.")


def test_deepseek_r1_reads_an_unclosed_reply_as_reasoning_cut_short():
    client, _, engine = think_client("Still thinking", parser="deepseek_r1")
    engine.finish_reason = "length"
    message = message_of(post(client, max_tokens=14))
    assert (message["reasoning_content"], message["content"]) == ("Still thinking", None)


def test_an_earlier_turns_reasoning_reaches_the_template():
    client, tokenizer, engine = think_client(REPLY)
    first = message_of(post(client))
    conversation = [*USER, first, {"role": "user", "content": "And Spain?"}]
    assert post(client, messages=conversation).status_code == 200
    prompt = tokenizer.decode(engine.prompts[-1], skip_special_tokens=False)
    assert "<think>\nThe user wants {JSON}.\nParis it is.\n</think>\n\nParis.<|im_end|>" in prompt


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}


@pytest.mark.parametrize("opens", [False, True], ids=["model-opens", "template-opens"])
@pytest.mark.parametrize("stream", [False, True])
def test_response_format_holds_the_answer_after_the_reasoning(stream, opens):
    reasoning = "The user wants {JSON}.\nParis it is."
    script = ("" if opens else "<think>\n") + reasoning + "\n</think>\n\n"
    client, _, engine = think_client(script, opens=opens, grammar=True)
    response = post(client, response_format=SCHEMA_FORMAT, n=3, stream=stream)
    if stream:
        joined, _ = streamed(response)
        replies = [(j["reasoning_content"], j["content"]) for j in joined.values()]
    else:
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert all(c["finish_reason"] == "stop" for c in choices)
        replies = [(c["message"]["reasoning_content"], c["message"]["content"]) for c in choices]
    for reasoning_content, content in replies:
        assert reasoning_content == reasoning
        jsonschema.validate(json.loads(content), CITY)
    assert len({content for _, content in replies}) > 1  # drawn: the grammar, not a script
    assert "%json" in engine.params[0].structured_outputs.grammar


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "find"}}])
def test_a_demanded_call_follows_the_reasoning(choice):
    script = "<think>\nI need the tool.\n</think>\n\n"
    client, _, _ = think_client(script, grammar=True)
    response = post(client, tools=[FIND], tool_choice=choice, parallel_tool_calls=False)
    assert response.status_code == 200, response.text
    (choice_,) = response.json()["choices"]
    message = choice_["message"]
    assert choice_["finish_reason"] == "tool_calls"
    assert message["reasoning_content"] == "I need the tool." and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "find"
    jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)
