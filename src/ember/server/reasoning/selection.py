"""The reasoning formats --reasoning-parser names (vLLM's names), and which one a served model's
replies are read in.

- ``openai_gptoss``: gpt-oss's harmony channels (`ember.server.harmony`); chosen without the
  flag for a tokenizer with harmony's special tokens, which no other format has.
- ``qwen3`` and ``deepseek_r1``: reasoning between `<think>` and `</think>`
  (`ember.server.reasoning.think`); only by the flag. Many tokenizers hold the two tags
  without their model ever thinking (Qwen3's instruct-only releases), and the two formats read
  a reply without tags differently (``qwen3``: the answer; ``deepseek_r1``: reasoning cut
  short), so neither the vocabulary nor the template says which applies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ember.server.reasoning.think import ThinkTags, prompt_opens_thinking

HARMONY_REASONING_PARSER = "openai_gptoss"
QWEN3 = "qwen3"
DEEPSEEK_R1 = "deepseek_r1"
THINK_TAG_PARSERS = (DEEPSEEK_R1, QWEN3)
REASONING_PARSER_NAMES = (DEEPSEEK_R1, HARMONY_REASONING_PARSER, QWEN3)
# Prompt tokens decoded to see whether the prompt left a <think> block open (a generation
# prompt is a few tokens).
PROMPT_TAIL_TOKENS = 16


def prompt_think_tags(
    reasoning_parser: str | None, prompt_ids: Sequence[int], decode: Callable[..., str]
) -> ThinkTags | None:
    """`think_tags` for the prompt ``prompt_ids``, its end read by ``decode`` (the
    tokenizer's) only where ``reasoning_parser`` reads `<think>` blocks."""
    if reasoning_parser not in THINK_TAG_PARSERS:
        return None
    tail = decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
    return think_tags(reasoning_parser, tail)


def think_tags(reasoning_parser: str | None, prompt_tail: str) -> ThinkTags | None:
    """How a reply to a prompt ending with ``prompt_tail`` (its rendered text) holds its
    reasoning under ``reasoning_parser``; None where the parser reads no `<think>` block.
    ``deepseek_r1`` starts inside the block whatever the prompt says (its templates open it);
    ``qwen3`` where the prompt left it open."""
    if reasoning_parser == DEEPSEEK_R1:
        return ThinkTags(starts_inside=True)
    if reasoning_parser == QWEN3:
        return ThinkTags(starts_inside=prompt_opens_thinking(prompt_tail))
    return None
