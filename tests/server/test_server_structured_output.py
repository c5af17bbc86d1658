"""Structured output through the real server (SmolLM2 on the CPU), in the shapes clients send
it: OpenAI's `response_format`, vLLM's `guided_*` fields and `structured_outputs`, streamed and
whole; tool_choice "required" and named, enforced; invalid constraints answered with a 400
naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from helpers.tools import function_tool

pytestmark = pytest.mark.slow

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}
ASK_CITY = [{"role": "user", "content": "Describe Paris as JSON."}]
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "city", "schema": CITY, "strict": True},
}


def chat_texts(client, model_name, stream: bool, **fields) -> list[tuple[str, str]]:
    """Each choice's (content, finish_reason), streamed or whole."""
    request = dict(model=model_name, messages=ASK_CITY, max_tokens=80, stream=stream, **fields)
    if not stream:
        reply = client.chat.completions.create(**request)
        return [(c.message.content, c.finish_reason) for c in reply.choices]
    texts, reasons = {}, {}
    for chunk in client.chat.completions.create(**request):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    return [(texts[i], reasons[i]) for i in sorted(texts)]


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema(client, model_name, stream):
    replies = chat_texts(
        client, model_name, stream, response_format=JSON_SCHEMA_FORMAT, n=3, temperature=0.8
    )
    for text, reason in replies:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), CITY)


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_object(client, model_name, stream):
    replies = chat_texts(
        client,
        model_name,
        stream,
        response_format={"type": "json_object"},
        temperature=0,
    )
    for text, reason in replies:
        assert reason == "stop", text
        assert isinstance(json.loads(text), dict)


def completion_texts(client, model_name, stream: bool, **extra) -> list[str]:
    request = {
        "model": model_name,
        "prompt": "My favourite colour is",
        "max_tokens": 40,
        "n": 2,
        "temperature": 0.7,
        "seed": 3,
        "extra_body": extra,
    }
    if not stream:
        reply = client.completions.create(**request)
        assert all(choice.finish_reason == "stop" for choice in reply.choices)
        return [choice.text for choice in reply.choices]
    texts: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **request):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return list(texts.values())


COLOURS = ["red", "dark green", "blue"]
CONSTRAINTS = {
    "guided_choice": ({"guided_choice": COLOURS}, lambda text: text in COLOURS),
    "guided_regex": (
        {"guided_regex": r"#[0-9a-f]{6}"},
        lambda text: re.fullmatch(r"#[0-9a-f]{6}", text) is not None,
    ),
    "guided_json": (
        {"guided_json": json.dumps({"type": "array", "items": {"enum": COLOURS}, "maxItems": 3})},
        lambda text: set(json.loads(text)) <= set(COLOURS),
    ),
    "guided_grammar": (
        {"guided_grammar": 'root ::= "rgb(" [0-9] [0-9]? "," [0-9] [0-9]? ")"'},
        lambda text: re.fullmatch(r"rgb\(\d\d?,\d\d?\)", text) is not None,
    ),
    "structured_outputs": (
        {"structured_outputs": {"choice": COLOURS}},
        lambda text: text in COLOURS,
    ),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field", CONSTRAINTS)
def test_vllm_fields_on_completions(client, model_name, field, stream):
    extra, valid = CONSTRAINTS[field]
    for text in completion_texts(client, model_name, stream, **extra):
        assert valid(text), text


INVALID = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
        "response_format",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"guided_regex": "a(("}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_grammar": "start: nowhere"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
]


@pytest.mark.parametrize(("fields", "param"), INVALID)
def test_an_invalid_or_second_constraint_is_a_400_naming_it(http, model_name, fields, param):
    body = {"model": model_name, "messages": ASK_CITY, "max_tokens": 4, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


WEATHER = function_tool("get_weather", city={"type": "string", "maxLength": 16})
TIME = function_tool("get_time", zone={"enum": ["UTC", "CET"]})
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_a_demanded_tool_call_is_made(client, model_name, tool_choice, stream):
    """The session server reads hermes calls: the reply is held to `<tool_call>` JSON of one of
    the tools (of the named one), with arguments that match its parameters. One call: with
    parallel calls allowed, SmolLM2 writes the same call again and again."""
    request = {
        "model": model_name,
        "messages": ASK_WEATHER,
        "tools": [WEATHER, TIME],
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "max_tokens": 60,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        calls, reason = [], None
        for chunk in client.chat.completions.create(**request):
            for choice in chunk.choices:
                calls += choice.delta.tool_calls or []
                reason = choice.finish_reason or reason
    else:
        choice = client.chat.completions.create(**request).choices[0]
        calls, reason = choice.message.tool_calls, choice.finish_reason
    assert reason == "tool_calls" and calls
    parameters = {
        tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)
    }
    for call in calls:
        assert tool_choice == "required" or call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])


def test_a_demanded_call_and_a_response_format_is_a_400(http, model_name):
    body = {
        "model": model_name,
        "messages": ASK_WEATHER,
        "tools": [WEATHER],
        "tool_choice": "required",
        "response_format": {"type": "json_object"},
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
