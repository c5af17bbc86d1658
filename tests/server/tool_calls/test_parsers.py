"""Each model family's tool-call format read from fixed outputs, whole."""

from __future__ import annotations

import json

import pytest

from ember.server.tool_calls.registry import PARSERS, parser_name_for
from ember.server.tool_calls.stream import parse_output

NESTED = {"city": "Zürich 東京", "filter": {"days": [1, 2], "note": 'a "}" ]'}, "ok": None}


def calls_of(parser: str, text: str) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parse_output(PARSERS[parser], text).calls]


def hermes(name: str, arguments: dict) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def llama(name: str, arguments: dict) -> str:
    return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


def mistral(*calls: tuple[str, dict]) -> str:
    body = [{"name": name, "arguments": arguments} for name, arguments in calls]
    return "[TOOL_CALLS]" + json.dumps(body, ensure_ascii=False)


# (parser, output, calls expected, content expected)
CASES = {
    "hermes one call": ("hermes", hermes("get_weather", NESTED), [("get_weather", NESTED)], None),
    "hermes several calls": (
        "hermes",
        hermes("a", {"x": 1}) + "\n" + hermes("b", {}),
        [("a", {"x": 1}), ("b", {})],
        None,
    ),
    "hermes text before": (
        "hermes",
        "Let me look.\n" + hermes("a", {"q": "é"}),
        [("a", {"q": "é"})],
        "Let me look.\n",
    ),
    "hermes without the closing tag at the end": (
        "hermes",
        hermes("a", NESTED).removesuffix("</tool_call>"),
        [("a", NESTED)],
        None,
    ),
    "llama3 bare call": (
        "llama3_json",
        llama("get_weather", NESTED),
        [("get_weather", NESTED)],
        None,
    ),
    "llama3 python tag, two calls": (
        "llama3_json",
        "<|python_tag|>" + llama("a", {}) + "; " + llama("b", NESTED),
        [("a", {}), ("b", NESTED)],
        None,
    ),
    "llama3 text before the python tag": (
        "llama3_json",
        "Checking. <|python_tag|>" + llama("a", {"x": [1]}),
        [("a", {"x": [1]})],
        "Checking. ",
    ),
    "mistral list of calls": (
        "mistral",
        mistral(("a", NESTED), ("b", {})),
        [("a", NESTED), ("b", {})],
        None,
    ),
    "mistral marker skipped as a special token": (
        "mistral",
        mistral(("a", {"x": 1})).removeprefix("[TOOL_CALLS]"),
        [("a", {"x": 1})],
        None,
    ),
    "mistral v11 named calls after text": (
        "mistral",
        'Sure: [TOOL_CALLS]a[ARGS]{"x": "ü"}[TOOL_CALLS]b[ARGS]{}',
        [("a", {"x": "ü"}), ("b", {})],
        "Sure: ",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_calls_are_read_with_the_text_before_them_as_content(case):
    parser, text, calls, content = CASES[case]
    assert calls_of(parser, text) == calls
    assert parse_output(PARSERS[parser], text).content == content


MALFORMED = {
    "hermes": [
        '<tool_call>{"name": "a", "arguments": {x}}</tool_call>',
        "<tool_call>{}</tool_call>",
    ],
    "llama3_json": ['{"name": "a", "parameters": {"x": 1}', '{"answer": 42}', "{not json}"],
    "mistral": ['[TOOL_CALLS][{"name": 1}]', '[TOOL_CALLS][{"name": "a"', "[1] is a citation"],
}


@pytest.mark.parametrize(
    ("parser", "text"), [(p, t) for p, texts in MALFORMED.items() for t in texts]
)
def test_malformed_calls_are_no_call_and_all_the_text_is_content(parser, text):
    parsed = parse_output(PARSERS[parser], text)
    assert parsed.calls == []
    assert parsed.content == text


@pytest.mark.parametrize("parser", PARSERS)
def test_plain_text_is_content(parser):
    text = "The weather in Paris is mild; {it} rains [often]."
    parsed = parse_output(PARSERS[parser], text)
    assert (parsed.content, parsed.calls) == (text, [])


def test_calls_carry_fresh_openai_ids_and_arguments_as_json_text():
    first, second = parse_output(PARSERS["hermes"], hermes("a", NESTED) + hermes("a", {})).calls
    entry = first.to_openai(index=0)
    assert entry["id"].startswith("call_") and first.id != second.id
    assert entry["type"] == "function" and entry["index"] == 0
    assert json.loads(entry["function"]["arguments"]) == NESTED
    assert "Zürich 東京" in entry["function"]["arguments"]  # not \u-escaped


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("... <tool_call>\\n{...}</tool_call> ...", "hermes"),
        ("{{ '[TOOL_CALLS]' + tool_calls|tojson }}", "mistral"),
        ("{{ '<|python_tag|>' + tool_call.name }}", "llama3_json"),
        ('{{ \'{"name": "\' + name + \'", "parameters": \' }}', "llama3_json"),
        ("{{ '<|im_start|>' + message.content }}", None),
        (None, None),
    ],
)
def test_the_parser_is_guessed_from_the_chat_template(template, expected):
    assert parser_name_for(None, template) == expected


def test_a_configured_parser_wins_and_an_unknown_one_is_refused():
    assert parser_name_for("mistral", "<tool_call>") == "mistral"
    with pytest.raises(ValueError, match="hermes"):
        parser_name_for("json", None)
