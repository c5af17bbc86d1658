"""The offline API reads a chat reply's reasoning as the server does: gpt-oss's harmony by its
tokenizer (from the tokens, whatever skip_special_tokens gave the text), `<think>` blocks by the
reasoning parser named, where the prompt left the block."""

from __future__ import annotations

import pytest
from helpers.harmony import harmony_tokenizer
from helpers.think import think_template, think_tokenizer

from ember.api import CompletionOutput, RequestOutput
from ember.chat_reasoning import ChatReasoning

HARMONY_REPLY = (
    "<|channel|>analysis<|message|>Greet back.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>"
)


def output_of(tokenizer, prompt: str, reply: str, skip_special_tokens: bool = True):
    ids = tokenizer.encode(reply, add_special_tokens=False)
    completion = CompletionOutput(0, tokenizer.decode(ids, skip_special_tokens), ids)
    return RequestOutput(
        "0", None, tokenizer.encode(prompt, add_special_tokens=False), [completion]
    )


def test_a_harmony_reply_is_read_from_its_tokens():
    tokenizer = harmony_tokenizer()
    output = output_of(tokenizer, "<|start|>assistant", HARMONY_REPLY)
    assert output.outputs[0].text == "analysisGreet back.assistantfinalHello!"  # markers gone
    ChatReasoning(tokenizer, None).read([output])
    completion = output.outputs[0]
    assert (completion.reasoning_content, completion.content) == ("Greet back.", "Hello!")


@pytest.mark.parametrize(
    ("parser", "prompt", "expected"),
    [
        ("qwen3", "<|im_start|>assistant\n", (None, "Paris.\n</think>\n\nParis.")),
        ("qwen3", "<|im_start|>assistant\n<think>\n", ("Paris.", "Paris.")),
        ("deepseek_r1", "<|im_start|>assistant\n", ("Paris.", "Paris.")),
        (None, "<|im_start|>assistant\n<think>\n", (None, None)),  # no parser: not read
    ],
)
def test_a_think_reply_is_read_where_the_prompt_left_the_block(parser, prompt, expected):
    tokenizer = think_tokenizer(think_template(opens_thinking=True))
    output = output_of(tokenizer, prompt, "Paris.\n</think>\n\nParis.")
    ChatReasoning(tokenizer, parser).read([output])
    completion = output.outputs[0]
    assert (completion.reasoning_content, completion.content) == expected


def test_an_unknown_reasoning_parser_is_refused():
    with pytest.raises(ValueError, match="choose from deepseek_r1, openai_gptoss, qwen3"):
        ChatReasoning(think_tokenizer(), "granite")
