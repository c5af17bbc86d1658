"""Streamed output split into content and calls: at any split the same as read whole, content
released as soon as it cannot be a call, a possible call held back."""

from __future__ import annotations

import pytest

from ember.server.tool_calls.registry import PARSERS
from ember.server.tool_calls.stream import ToolCallStream, parse_output

OUTPUTS = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": "é}"}}\n</tool_call>'),
    (
        "hermes",
        (
            '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", '
            '"arguments": {"y": [1, {"z": null}]}}</tool_call>\nDone.'
        ),
    ),
    ("hermes", '<tool_call>{"name": "a", "arguments": {oops}}</tool_call> and <tool_ then text'),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {"q": "東京"}}; {"name": "b", "parameters": {}}',
    ),
    ("llama3_json", '  {"name": "a", "parameters": {"q": 1}}'),
    ("llama3_json", '{"not": "a call"} but text'),
    ("mistral", 'Ok. [TOOL_CALLS][{"name": "a", "arguments": {"n": {"m": []}}}]'),
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}'),
    ("mistral", "[TOOL_CALLS oh no, not a call"),
]


def streamed(parser: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    stream = ToolCallStream(PARSERS[parser])
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    content = "".join(d.content for d in deltas)
    return content, [(c.name, c.arguments) for d in deltas for c in d.calls]


def whole(parser: str, text: str) -> tuple[str, list[tuple[str, str]]]:
    parsed = parse_output(PARSERS[parser], text)
    return parsed.content or "", [(c.name, c.arguments) for c in parsed.calls]


@pytest.mark.parametrize(("parser", "text"), OUTPUTS)
def test_every_split_point_gives_what_the_whole_text_gives(parser, text):
    expected = whole(parser, text)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):  # two cuts: i and every 7th point after it
            assert streamed(parser, [text[:i], text[i:j], text[j:]]) == expected, (i, j)
    assert streamed(parser, list(text)) == expected  # one character at a time


def test_content_is_released_at_once_and_a_call_only_when_whole():
    stream = ToolCallStream(PARSERS["hermes"])
    assert stream.feed("Hello <tool").content == "Hello "  # "<tool" may open a call
    held = stream.feed('_call>{"name": "a", "arguments": {}}')
    assert (held.content, held.calls) == ("", [])
    done = stream.feed("</tool_call>")
    assert [c.name for c in done.calls] == ["a"]
    assert stream.feed(" bye").content == " bye"


def test_a_held_prefix_that_is_not_a_marker_is_released_as_content():
    stream = ToolCallStream(PARSERS["hermes"])
    assert stream.feed("a <tool").content == "a "
    assert stream.feed("box").content == "<toolbox"


def test_a_bare_json_call_is_held_only_where_the_reply_starts():
    stream = ToolCallStream(PARSERS["llama3_json"])
    assert stream.feed('{"name": ').content == ""
    stream = ToolCallStream(PARSERS["llama3_json"])
    assert stream.feed('Use {"name": ').content == 'Use {"name": '


def test_an_unfinished_call_at_the_end_is_content():
    text = '<tool_call>{"name": "a", "arguments": {"x": '
    assert streamed("hermes", [text]) == (text, [])


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", '\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n\n'),
        ("llama3_json", ' {"name": "a", "parameters": {}} ;\n'),
    ],
)
def test_whitespace_around_calls_is_not_streamed_as_content(parser, text):
    for i in range(len(text) + 1):
        assert streamed(parser, [text[:i], text[i:]]) == ("", [("a", "{}")]), i
