"""The harmony reader splits gpt-oss's reply into reasoning, content and tool calls, the same
whether the reply comes whole, a token at a time, or in pieces that split its markers."""

from __future__ import annotations

import json
import random

import pytest

from ember.server.harmony.parser import HarmonyReader
from ember.server.reply import ReplyDelta, read_reply

ANSWER = (
    "<|channel|>analysis<|message|>The user greets; answer <briefly>.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! 2 < 3 and <b>bold</b>.<|return|>"
)
CALL = (
    "<|channel|>analysis<|message|>Need the weather tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Zürich", "days": [1, 2]}<|call|>'
)
# Tokens as o200k_harmony cuts such a reply: each marker one token, words in pieces.
TOKENS = [
    "<|channel|>", "analysis", "<|message|>", "Think", "ing", " hard", "<|end|>",
    "<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "Hel", "lo", "!",
    "<|return|>",
]  # fmt: skip


def streamed(pieces: list[str], read_calls: bool = True) -> tuple[ReplyDelta, list[ReplyDelta]]:
    """Every piece fed to one reader: the deltas merged, and each piece's own."""
    reader = HarmonyReader(read_calls)
    deltas = [reader.feed(piece) for piece in pieces] + [reader.finish()]
    merged = ReplyDelta()
    for delta in deltas:
        merged.extend(delta)
    return merged, deltas


def random_pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=len(text) // 4))
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]


def test_a_whole_reply_splits_into_reasoning_and_content():
    reply = read_reply(HarmonyReader(), ANSWER)
    assert reply.reasoning == "The user greets; answer <briefly>."
    assert reply.content == "Hello! 2 < 3 and <b>bold</b>."
    assert reply.calls == []


def test_tokens_one_at_a_time_are_released_as_they_come():
    merged, deltas = streamed(TOKENS)
    assert merged.reasoning == "Thinking hard" and merged.content == "Hello!"
    # Text is never held back once it cannot be a marker: each word piece shows at once.
    shown = [d.reasoning or d.content for d in deltas]
    assert shown == ["", "", "", "Think", "ing", " hard", *[""] * 6, "Hel", "lo", "!", "", ""]


@pytest.mark.parametrize("text", [ANSWER, CALL])
def test_one_character_at_a_time_is_the_whole_reply(text):
    whole = read_reply(HarmonyReader(), text)
    merged, _ = streamed(list(text))
    assert merged.reasoning == whole.reasoning
    assert (merged.content or None) == whole.content
    assert [c.name for c in merged.calls if c.name] == [c.name for c in whole.calls]
    assert "".join(c.arguments for c in merged.calls) == "".join(c.arguments for c in whole.calls)


@pytest.mark.parametrize("seed", range(20))
def test_markers_split_across_pieces_never_leak(seed):
    merged, deltas = streamed(random_pieces(ANSWER, seed))
    assert merged.reasoning == "The user greets; answer <briefly>."
    assert merged.content == "Hello! 2 < 3 and <b>bold</b>."
    for delta in deltas:
        assert "<|" not in delta.reasoning + delta.content


def test_a_piece_that_may_start_a_marker_is_held_until_the_next_says():
    reader = HarmonyReader()
    assert reader.feed("<|channel|>final<|message|>a <").content == "a "
    assert reader.feed("|").content == ""
    assert reader.feed("x").content == "<|x"  # not a marker after all
    assert reader.feed("<|re").content == ""
    assert reader.feed("turn|>").content == ""
    assert reader.finish() == ReplyDelta()


def test_a_tool_call_streams_its_name_then_its_arguments():
    merged, deltas = streamed(random_pieces(CALL, seed=3))
    first = next(call for d in deltas for call in d.calls)
    assert first.index == 0 and first.name == "get_weather"
    assert first.id is not None and first.id.startswith("call_")
    later = [call for d in deltas for call in d.calls][1:]
    assert all(c.index == 0 and c.name is None and c.id is None for c in later)
    assert merged.reasoning == "Need the weather tool." and merged.content == ""
    (call,) = merged.calls
    assert json.loads(call.arguments) == {"city": "Zürich", "days": [1, 2]}


def test_a_whole_tool_call():
    reply = read_reply(HarmonyReader(), CALL)
    assert reply.content is None and reply.reasoning == "Need the weather tool."
    (call,) = reply.calls
    assert call.name == "get_weather" and call.id.startswith("call_")
    assert call.arguments == '{"city": "Zürich", "days": [1, 2]}'


@pytest.mark.parametrize(
    "text",
    [
        # the recipient after the role, as the chat template writes earlier calls
        ' to=functions.get_time<|channel|>commentary json<|message|> {"tz": "UTC"} \n<|call|>',
        '<|channel|>commentary to=functions.get_time json<|message|>{"tz": "UTC"}<|call|>',
        # a second message's header with the recipient after its role
        (
            "<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.get_time"
            '<|channel|>commentary <|constrain|>json<|message|>{"tz": "UTC"}<|call|>'
        ),
    ],
)
def test_call_headers_in_each_spelling(text):
    (call,) = read_reply(HarmonyReader(), text).calls
    assert call.name == "get_time" and call.arguments == '{"tz": "UTC"}'  # spaces trimmed


def test_a_call_without_arguments_has_an_empty_object():
    text = "<|channel|>commentary to=functions.now <|constrain|>json<|message|><|call|>"
    (call,) = read_reply(HarmonyReader(), text).calls
    assert call.arguments == "{}"


def test_analysis_cut_short_by_max_tokens_is_reasoning_only():
    reply = read_reply(HarmonyReader(), "<|channel|>analysis<|message|>Let me th")
    assert reply.reasoning == "Let me th" and reply.content is None and reply.calls == []


def test_a_reply_cut_inside_a_header_says_nothing_of_it():
    reply = read_reply(HarmonyReader(), "<|channel|>analysis<|message|>ok<|end|><|start|>assis")
    assert reply.reasoning == "ok" and reply.content is None


def test_a_header_that_never_ends_is_content_not_held_forever():
    text = "<|channel|>final " + "word " * 200
    reader = HarmonyReader()
    shown = reader.feed(text).content
    assert shown == text and reader.finish() == ReplyDelta()


def test_a_call_cut_short_keeps_the_arguments_written():
    text = '<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Zü'
    (call,) = read_reply(HarmonyReader(), text).calls
    assert call.arguments == '{"city": "Zü'


@pytest.mark.parametrize(
    "text",
    ["Just plain text, no markers.", "<b>bold</b> and <|im_end|> as text", " tomorrow", ""],
)
def test_text_without_harmony_markup_is_content_as_written(text):
    whole = read_reply(HarmonyReader(), text)
    assert whole.content == text and whole.reasoning is None and whole.calls == []
    merged, _ = streamed(list(text))
    assert merged.content == text


def test_plain_text_ended_by_the_stop_token_loses_only_the_token():
    assert read_reply(HarmonyReader(), "Hi there<|return|>").content == "Hi there"


def test_a_commentary_preamble_is_content_and_a_builtin_tool_is_reasoning():
    text = (
        "<|channel|>commentary<|message|>Checking the web.<|end|>"
        "<|start|>assistant<|channel|>analysis to=browser.search <|constrain|>json<|message|>"
        '{"query": "x"}<|call|>'
    )
    reply = read_reply(HarmonyReader(), text)
    assert reply.content == "Checking the web."
    assert reply.reasoning == '{"query": "x"}' and reply.calls == []


def test_without_tools_offered_a_call_is_reasoning():
    reply = read_reply(HarmonyReader(read_calls=False), CALL)
    assert reply.calls == [] and reply.content is None
    assert reply.reasoning == 'Need the weather tool.{"city": "Zürich", "days": [1, 2]}'


def test_readers_of_two_choices_keep_their_own_state():
    first, second = HarmonyReader(), HarmonyReader()
    first.feed("<|channel|>analysis<|mess")
    second.feed("<|channel|>final<|message|>B")
    assert first.feed("age|>A").reasoning == "A"
    assert second.feed("b").content == "b"
    calls = [HarmonyReader().feed(CALL).calls[0].id for _ in range(2)]
    assert calls[0] != calls[1]  # every call its own id
