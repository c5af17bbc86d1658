"""/v1/chat/completions for gpt-oss, through the real route and `serving_chat`, over a scripted
engine that replies with the token ids of a harmony reply (`tool_calls.fake_server`) and a
tokenizer with harmony's special tokens (each marker one token, as gpt-oss's): the analysis
channel comes back as `reasoning_content`, the final one as `content`, calls to functions as
`tool_calls`, whole and streamed; earlier turns render through gpt-oss's chat template. A
response_format holds the final message and a demanded call its arguments, after free analysis
(the engine stand-in writes the analysis, then whatever the grammar allows)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers.grammar_writer import GrammarWriter
from helpers.harmony import GPT_OSS_TEMPLATE, harmony_tokenizer

from ember.structured_output.compiler import GrammarCompiler
from ember.tokenizer.harmony import harmony_stop_token_ids

from ..tool_calls.fake_server import GrammarEngine, chat_client

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
USER = [{"role": "user", "content": "Weather in Zürich?"}]
ARGS = {"city": "Zürich"}
ANSWER = (
    "<|channel|>analysis<|message|>Simple greeting, reply briefly.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello, <friend>!<|return|>"
)
CALL = (
    "<|channel|>analysis<|message|>Use the weather tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    f"<|message|>{json.dumps(ARGS, ensure_ascii=False)}<|call|>"
)


def harmony_client(reply: str, **engine_fields):
    """A gpt-oss-like model (found by its tokenizer's tokens, no flag) that writes `reply`."""
    tokenizer = harmony_tokenizer()
    ids = tokenizer.encode(reply, add_special_tokens=False)
    client, _, engine = chat_client(GPT_OSS_TEMPLATE, ids, tokenizer=tokenizer)
    for name, value in engine_fields.items():
        setattr(engine, name, value)
    return client, tokenizer, engine


def post(client, messages=USER, **body):
    return client.post("/v1/chat/completions", json={"messages": messages, **body})


def events(response) -> list[dict]:
    assert response.status_code == 200, response.text
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def joined(deltas: list[dict], key: str) -> str:
    return "".join(d.get(key) or "" for d in deltas)


def test_reasoning_and_content_whole():
    client, _, engine = harmony_client(ANSWER)
    response = post(client)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"] == {
        "role": "assistant",
        "content": "Hello, <friend>!",
        "reasoning_content": "Simple greeting, reply briefly.",
    }
    assert choice["finish_reason"] == "stop"
    assert engine.params[0].skip_special_tokens is False  # the markers reach the reader


@pytest.mark.parametrize("chunk", [1, 3])
def test_reasoning_and_content_streamed(chunk):
    client, _, _ = harmony_client(ANSWER, chunk=chunk)
    chunks = events(post(client, stream=True, n=2))
    for index in (0, 1):  # every choice has its own reader
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == index]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert joined(deltas, "reasoning_content") == "Simple greeting, reply briefly."
        assert joined(deltas, "content") == "Hello, <friend>!"
        assert not any("<|" in json.dumps(d) for d in deltas)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes.count("stop") == 2


def test_a_tool_call_whole():
    client, _, _ = harmony_client(CALL)
    response = post(client, tools=[WEATHER])
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None and message["reasoning_content"] == "Use the weather tool."
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == ARGS


def test_a_tool_call_streamed_name_first_then_arguments():
    client, _, _ = harmony_client(CALL, chunk=1)
    chunks = events(post(client, tools=[WEATHER], stream=True))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    entries = [entry for d in deltas for entry in d.get("tool_calls", [])]
    first, *rest = entries
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    # (the updates of a loaded event loop may come merged: then fewer, longer pieces)
    assert first["function"]["name"] == "get_weather"
    assert all(set(e) == {"index", "function"} and e["index"] == 0 for e in rest)
    assert all(set(e["function"]) == {"arguments"} for e in rest)
    arguments = "".join(e["function"]["arguments"] for e in entries)
    assert json.loads(arguments) == ARGS
    assert joined(deltas, "reasoning_content") == "Use the weather tool."
    assert joined(deltas, "content") == ""
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_without_tools_a_call_is_reasoning_not_tool_calls():
    client, _, _ = harmony_client(CALL)
    choice = post(client).json()["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
    assert choice["message"]["reasoning_content"].startswith("Use the weather tool.")


@pytest.mark.parametrize("stream", [False, True])
def test_analysis_cut_by_max_tokens(stream):
    client, _, _ = harmony_client(
        "<|channel|>analysis<|message|>Let me think ab", finish_reason="length"
    )
    response = post(client, max_tokens=8, stream=stream)
    if stream:
        chunks = events(response)
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert joined(deltas, "reasoning_content") == "Let me think ab"
        assert joined(deltas, "content") == ""
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    else:
        choice = response.json()["choices"][0]
        assert choice["message"]["content"] is None
        assert choice["message"]["reasoning_content"] == "Let me think ab"
        assert choice["finish_reason"] == "length"


def test_a_reply_without_harmony_markup_is_content():
    client, _, _ = harmony_client("Plain words <|return|>")
    message = post(client).json()["choices"][0]["message"]
    assert message["content"] == "Plain words " and message["reasoning_content"] is None


ANALYSIS = "<|channel|>analysis<|message|>They want {JSON}; a city.<|end|><|start|>assistant"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"enum": [1, 2]}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}
CLOSED_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}


def grammar_client(script: str):
    """gpt-oss writing ``script``, then what the request's grammar allows (a script that
    stops at a header leaves the writer free to add analysis messages at random)."""
    tokenizer = harmony_tokenizer()
    eos = harmony_stop_token_ids(tokenizer.added_token_id)
    writer = GrammarWriter(GrammarCompiler(tokenizer, tokenizer.vocab_size, eos), eos)
    engine = GrammarEngine(tokenizer.encode(script, add_special_tokens=False), writer)
    client, _, engine = chat_client(GPT_OSS_TEMPLATE, [], tokenizer=tokenizer, engine=engine)
    return client, engine


def stream_messages(response) -> list[dict]:
    """Each choice's stream joined: reasoning, content and calls (arguments joined)."""
    joined: dict[int, dict] = {}
    for chunk in events(response):
        for choice in chunk["choices"]:
            message = joined.setdefault(
                choice["index"], {"reasoning_content": "", "content": "", "tool_calls": {}}
            )
            delta = choice["delta"]
            for key in ("reasoning_content", "content"):
                message[key] += delta.get(key) or ""
            for entry in delta.get("tool_calls", []):
                call = message["tool_calls"].setdefault(
                    entry["index"], {"name": None, "arguments": ""}
                )
                call["name"] = entry["function"].get("name") or call["name"]
                call["arguments"] += entry["function"]["arguments"]
    return [joined[i] for i in sorted(joined)]


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_holds_the_final_message_after_the_analysis(stream):
    client, engine = grammar_client(ANALYSIS + "<|channel|>final<|message|>")
    response_format = {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}
    response = post(client, response_format=response_format, n=3, stream=stream)
    if stream:
        replies = [(m["reasoning_content"], m["content"]) for m in stream_messages(response)]
    else:
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert all(c["finish_reason"] == "stop" for c in choices)
        replies = [(c["message"]["reasoning_content"], c["message"]["content"]) for c in choices]
    for reasoning, content in replies:
        assert reasoning == "They want {JSON}; a city."
        jsonschema.validate(json.loads(content), CITY)
    assert len({content for _, content in replies}) > 1  # drawn under the grammar
    assert engine.params[0].skip_special_tokens is False


def test_the_final_message_may_come_without_analysis():
    client, _ = grammar_client("<|channel|>final<|message|>")
    response = post(client, guided_choice=["yes", "no"])
    message = response.json()["choices"][0]["message"]
    assert message["content"] in ("yes", "no") and message["reasoning_content"] is None


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("named", [False, True], ids=["required", "named"])
def test_a_demanded_call_is_made_with_valid_arguments(named, stream):
    client, _ = grammar_client(ANALYSIS + "<|channel|>commentary to=functions.")
    choice = {"type": "function", "function": {"name": "add"}} if named else "required"
    response = post(client, tools=[CLOSED_WEATHER, ADD], tool_choice=choice, n=4, stream=stream)
    if stream:
        messages = stream_messages(response)
        calls = [list(m["tool_calls"].values()) for m in messages]
        reasonings = [m["reasoning_content"] for m in messages]
    else:
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert all(c["finish_reason"] == "tool_calls" for c in choices)
        calls = [[c["function"] for c in choice["message"]["tool_calls"]] for choice in choices]
        reasonings = [choice["message"]["reasoning_content"] for choice in choices]
    schemas = {
        tool["function"]["name"]: tool["function"]["parameters"] for tool in (CLOSED_WEATHER, ADD)
    }
    for (call,), reasoning in zip(calls, reasonings, strict=True):
        assert reasoning == "They want {JSON}; a city."
        assert call["name"] == "add" or not named
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


def test_a_demanded_call_cannot_be_combined_with_a_response_format():
    client, _ = grammar_client(ANALYSIS)
    response = post(
        client, tools=[ADD], tool_choice="required", response_format={"type": "json_object"}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"


def test_earlier_reasoning_calls_and_results_render_through_the_template():
    client, tokenizer, engine = harmony_client(CALL)
    first = post(client, tools=[WEATHER]).json()["choices"][0]["message"]
    conversation = [
        *USER,
        first,  # as the client got it: content null, reasoning_content, tool_calls
        {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": '{"temp": -3}'},
    ]
    assert post(client, messages=conversation, tools=[WEATHER]).status_code == 200
    prompt = tokenizer.decode(engine.prompts[-1], skip_special_tokens=False)
    assert prompt.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Use the weather tool.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Zürich"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        '"{\\"temp\\": -3}"<|end|><|start|>assistant'
    )


def test_an_earlier_final_answer_drops_its_reasoning():
    client, tokenizer, engine = harmony_client(ANSWER)
    conversation = [
        *USER,
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "Guess."},
        {"role": "user", "content": "Thanks"},
    ]
    assert post(client, messages=conversation).status_code == 200
    prompt = tokenizer.decode(engine.prompts[-1], skip_special_tokens=False)
    assert "<|start|>assistant<|channel|>final<|message|>Sunny.<|end|>" in prompt
    assert "Guess." not in prompt  # gpt-oss's template drops earlier turns' reasoning


def test_the_reasoning_parser_flag_reads_harmony_from_any_tokenizer():
    # One token per character: the markers arrive in pieces, as text split across tokens.
    client, _, _ = chat_client(GPT_OSS_TEMPLATE, ANSWER, reasoning_parser="openai_gptoss")
    message = post(client).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "Simple greeting, reply briefly."
    assert message["content"] == "Hello, <friend>!"
