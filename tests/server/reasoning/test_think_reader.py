"""The `<think>` reader splits a reply into reasoning and the answer, the same whether the reply
comes whole, a character at a time, or in pieces that split its tags: from inside the block
(the prompt opened it, or deepseek_r1), or from a reply that may open it itself (qwen3), with
the answer read for tool calls where the request has tools."""

from __future__ import annotations

import random

import pytest

from ember.server.reasoning.selection import think_tags
from ember.server.reasoning.think import ThinkReader, ThinkTags, prompt_opens_thinking
from ember.server.reply import ReplyDelta, ToolCallReader, read_reply
from ember.server.tool_calls.registry import PARSERS

INSIDE = ThinkTags(starts_inside=True)
BEFORE = ThinkTags(starts_inside=False)
QWEN3_REPLY = "<think>\nThe user greets; answer <briefly>.\n</think>\n\nHello! 2 < 3 </thin>"
R1_REPLY = "The user greets; answer <briefly>.\n</think>\n\nHello! 2 < 3 </thin>"
REASONING = "The user greets; answer <briefly>."
CONTENT = "Hello! 2 < 3 </thin>"


def streamed(tags: ThinkTags, pieces: list[str], answer=None) -> tuple[ReplyDelta, list]:
    """Every piece fed to one reader: the deltas merged, and each piece's own."""
    reader = ThinkReader(tags, answer)
    deltas = [reader.feed(piece) for piece in pieces] + [reader.finish()]
    merged = ReplyDelta()
    for delta in deltas:
        merged.extend(delta)
    return merged, deltas


def random_pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=len(text) // 3))
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize(
    ("tags", "text"), [(BEFORE, QWEN3_REPLY), (INSIDE, QWEN3_REPLY), (INSIDE, R1_REPLY)]
)
def test_a_whole_reply_splits_into_reasoning_and_the_answer(tags, text):
    reply = read_reply(ThinkReader(tags), text)
    assert (reply.reasoning, reply.content, reply.calls) == (REASONING, CONTENT, [])


@pytest.mark.parametrize(
    ("tags", "text"), [(BEFORE, QWEN3_REPLY), (INSIDE, QWEN3_REPLY), (INSIDE, R1_REPLY)]
)
@pytest.mark.parametrize("split", ["characters", "random"])
def test_streamed_in_any_pieces_it_reads_as_whole(tags, text, split):
    pieces = list(text) if split == "characters" else random_pieces(text, seed=len(text))
    merged, _ = streamed(tags, pieces)
    assert (merged.reasoning, merged.content) == (REASONING, CONTENT)


def test_text_is_released_as_it_comes_except_what_may_be_a_tag():
    pieces = ["<th", "ink>\n", "Think", "ing </", "thin", "k>", "\n\n", "Hi", "!"]
    _, deltas = streamed(BEFORE, pieces)
    shown = [(d.reasoning, d.content) for d in deltas]
    assert shown == [
        ("", ""),  # a <think> may be coming
        ("", ""),  # the line break after <think> is not reasoning
        ("Think", ""),
        ("ing", ""),  # " </" held: the space may end the reasoning, "</" may be its tag
        ("", ""),
        ("", ""),
        ("", ""),  # whitespace after </think> is not content
        ("", "Hi"),
        ("", "!"),
        ("", ""),
    ]


def test_a_reply_cut_inside_the_block_is_all_reasoning():
    for tags, text in [(BEFORE, "<think>\nLet me think ab"), (INSIDE, "Let me think ab </thi")]:
        reply = read_reply(ThinkReader(tags), text)
        assert reply.content is None
        assert reply.reasoning in ("Let me think ab", "Let me think ab </thi")


def test_without_a_block_qwen3_reads_the_answer_and_deepseek_r1_reasoning():
    text = "Just an answer, no <think> here."
    assert read_reply(ThinkReader(BEFORE), text).content == text
    cut = read_reply(ThinkReader(INSIDE), text)  # never closed: reasoning, cut short
    assert cut.reasoning == text and cut.content is None


def test_only_a_think_that_opens_the_reply_opens_the_block():
    reply = read_reply(ThinkReader(BEFORE), "  \n<think>why</think>Because.")
    assert (reply.reasoning, reply.content) == ("why", "Because.")
    later = read_reply(ThinkReader(BEFORE), "Say <think>why</think>")
    assert (later.reasoning, later.content) == (None, "Say <think>why</think>")


def test_an_empty_block_gives_no_reasoning():
    reply = read_reply(ThinkReader(BEFORE), "<think>\n\n</think>\n\nHi.")
    assert (reply.reasoning, reply.content) == (None, "Hi.")


@pytest.mark.parametrize("split", ["whole", "characters"])
def test_the_answer_is_read_for_tool_calls(split):
    text = (
        '<think>\nCall it.\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
        "</tool_call>"
    )
    pieces = [text] if split == "whole" else list(text)
    merged, _ = streamed(BEFORE, pieces, ToolCallReader(PARSERS["hermes"]))
    assert merged.reasoning == "Call it." and merged.content == ""
    (call,) = merged.calls
    assert (call.name, call.arguments) == ("f", '{"a": 1}')


@pytest.mark.parametrize(
    ("tail", "opens"),
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # enable_thinking false
        ("<|im_start|>assistant\n", False),
        ("<think>old</think><|im_start|>assistant\n", False),
    ],
)
def test_a_prompt_leaves_the_block_open_or_not(tail, opens):
    assert prompt_opens_thinking(tail) is opens
    assert think_tags("qwen3", tail) == ThinkTags(starts_inside=opens)
    assert think_tags("deepseek_r1", tail) == INSIDE  # whatever the prompt
    assert think_tags("openai_gptoss", tail) is None and think_tags(None, tail) is None
