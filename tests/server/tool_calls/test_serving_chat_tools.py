"""/v1/chat/completions with tools, through the real route and `serving_chat`, over a scripted
engine (`fake_server`): the OpenAI shapes, whole and streamed, and what tool_choice does."""

from __future__ import annotations

import json

import pytest

from .fake_server import chat_client
from .templates import QWEN25_TEMPLATE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
ARGS = {"city": "Zürich", "units": {"temp": "C"}}
CALL = "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": ARGS}) + "\n</tool_call>"
REPLY = "Let me check." + CALL + '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
USER = [{"role": "user", "content": "Weather in Zürich?"}]


def post(client, **body):
    return client.post("/v1/chat/completions", json={"messages": USER, **body})


def events(response) -> list[dict]:
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_tool_calls_whole():
    client, tokenizer, _ = chat_client(QWEN25_TEMPLATE, REPLY)
    response = post(client, tools=[WEATHER, TIME])
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me check."
    first, second = message["tool_calls"]
    assert first["id"].startswith("call_") and first["id"] != second["id"]
    assert first["type"] == "function" and first["function"]["name"] == "get_weather"
    assert json.loads(first["function"]["arguments"]) == ARGS
    assert second["function"] == {"name": "get_time", "arguments": "{}"}
    assert '"name": "get_weather"' in tokenizer.rendered[0]  # the template showed the tools


def test_tool_calls_streamed_match_the_whole_response():
    client, _, _ = chat_client(QWEN25_TEMPLATE, REPLY)
    chunks = events(post(client, tools=[WEATHER, TIME], stream=True))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert content == "Let me check."  # no piece of the markup leaked as content
    assert [c["index"] for c in calls] == [0, 1]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == ARGS
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}


@pytest.mark.parametrize("stream", [False, True])
def test_text_that_is_no_call_is_content_with_finish_stop(stream):
    text = "It is <tool_callous> weather: {sunny}."
    client, _, _ = chat_client(QWEN25_TEMPLATE, text)
    response = post(client, tools=[WEATHER], stream=stream)
    if stream:
        chunks = events(response)
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("content") or "" for d in deltas) == text
        assert not any("tool_calls" in d for d in deltas)
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    else:
        choice = response.json()["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": text}
        assert choice["finish_reason"] == "stop"


def test_tool_choice_none_shows_no_tools_and_reads_no_calls():
    client, tokenizer, _ = chat_client(QWEN25_TEMPLATE, CALL)
    choice = post(client, tools=[WEATHER], tool_choice="none").json()["choices"][0]
    assert choice["message"]["content"] == CALL and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    assert "get_weather" not in tokenizer.rendered[0] and "<tools>" not in tokenizer.rendered[0]


def test_a_named_tool_choice_shows_the_model_that_tool_only():
    client, tokenizer, _ = chat_client(QWEN25_TEMPLATE, CALL)
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = post(client, tools=[TIME, WEATHER], tool_choice=named).json()["choices"][0]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    assert "get_weather" in tokenizer.rendered[0] and "get_time" not in tokenizer.rendered[0]


def test_required_without_a_call_in_the_reply_is_its_text_and_a_warning(caplog):
    """Decoding is held to calls (below), but a reply cut short (max_tokens, a stop string)
    may still hold none: it is returned as written, and logged."""
    client, _, _ = chat_client(QWEN25_TEMPLATE, "No tool for you.")
    choice = post(client, tools=[WEATHER], tool_choice="required").json()["choices"][0]
    assert choice["message"]["content"] == "No tool for you."
    assert choice["finish_reason"] == "stop"
    assert "'required' and the model called no tool" in caplog.text


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_call(stream):
    client, _, _ = chat_client(QWEN25_TEMPLATE, REPLY)
    response = post(client, tools=[WEATHER, TIME], parallel_tool_calls=False, stream=stream)
    if stream:
        deltas = [c["choices"][0]["delta"] for c in events(response)]
        calls = [call for d in deltas for call in d.get("tool_calls", [])]
    else:
        calls = response.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_n_choices_each_get_their_calls_with_their_own_indices():
    client, _, _ = chat_client(QWEN25_TEMPLATE, CALL)
    chunks = events(post(client, tools=[WEATHER], stream=True, n=2))
    calls = {0: [], 1: []}
    for chunk in chunks:
        choice = chunk["choices"][0]
        calls[choice["index"]] += choice["delta"].get("tool_calls", [])
    assert [[c["index"] for c in calls[i]] for i in (0, 1)] == [[0], [0]]


def test_a_configured_parser_replaces_the_templates():
    llama_call = json.dumps({"name": "get_weather", "parameters": ARGS})
    client, _, _ = chat_client(QWEN25_TEMPLATE, llama_call, tool_call_parser="llama3_json")
    calls = post(client, tools=[WEATHER]).json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(calls[0]["function"]["arguments"]) == ARGS


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"description": "no name"}}]},
            "tools.0.function.name",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "has space"}}]},
            "tools.0.function.name",
        ),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "parallel_tool_calls": "maybe"}, "parallel_tool_calls"),
    ],
)
def test_invalid_tool_fields_are_a_400_naming_the_parameter(body, param):
    client, _, engine = chat_client(QWEN25_TEMPLATE, CALL)
    response = post(client, **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param)
    assert engine.params == []  # nothing reached the engine


def test_tools_for_a_model_without_a_known_call_format_are_a_400():
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    client, _, _ = chat_client(plain, CALL)
    response = post(client, tools=[WEATHER])
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tools"
    assert "--tool-call-parser" in response.json()["error"]["message"]
    assert post(client, tools=[WEATHER], tool_choice="none").status_code == 200


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_required_and_named_choices_hold_decoding_to_calls(parser):
    """The engine gets a grammar of the parser's format whose call objects name the offered
    tools (only the named one for a named choice) with their parameters as the arguments'
    schema; auto and none constrain nothing."""
    client, _, engine = chat_client(QWEN25_TEMPLATE, CALL, tool_call_parser=parser)
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in ("required", named, "auto", "none"):
        assert post(client, tools=[WEATHER, TIME], tool_choice=choice).status_code == 200
    required, named_only, auto, none = (params.structured_outputs for params in engine.params)
    assert auto is None and none is None
    assert (
        '"const": "get_weather"' in required.grammar and '"const": "get_time"' in required.grammar
    )
    assert '"const": "get_time"' in named_only.grammar and "get_weather" not in named_only.grammar
    assert '"city": {"type": "string"}' in required.grammar  # the tool's parameters


def test_a_demanded_call_cannot_be_combined_with_a_response_format():
    client, _, engine = chat_client(QWEN25_TEMPLATE, CALL)
    body = {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "[a-z]+"}
    response = post(client, **body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    assert engine.params == []


def test_tool_parameters_that_do_not_compile_are_a_400_naming_tools():
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}
    client, _, engine = chat_client(QWEN25_TEMPLATE, CALL)
    response = post(client, tools=[broken], tool_choice="required")
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
    assert engine.params == []
