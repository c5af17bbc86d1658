"""The offline API's chat replies read as the server reads them, where the model reasons:
`CompletionOutput.reasoning_content` and `content` beside the text as generated.

The format is the server's choice too: gpt-oss's harmony channels for a tokenizer with their
tokens (or ``openai_gptoss``), a `<think>` block for ``qwen3`` and ``deepseek_r1``. A harmony
reply is read from its tokens decoded with their markers, whatever ``skip_special_tokens``
gave the text; its messages to tools are reasoning here (the offline API reads no tool calls).
"""

from __future__ import annotations

from collections.abc import Callable

from ember.server.harmony.parser import HarmonyReader
from ember.server.harmony.selection import uses_harmony
from ember.server.reasoning.selection import REASONING_PARSER_NAMES, prompt_think_tags
from ember.server.reasoning.think import ThinkReader
from ember.server.reply import ReplyReader, read_reply
from ember.tokenizer.tokenizer import Tokenizer


def check_reasoning_parser(name: str | None) -> None:
    """ValueError unless ``name`` is None or a reasoning parser ember reads."""
    if name is not None and name not in REASONING_PARSER_NAMES:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose from {', '.join(REASONING_PARSER_NAMES)}"
        )


class ChatReasoning:
    """Reads the replies to chat prompts of one model: ``reasoning_parser`` as the server's
    flag (None: harmony where the tokenizer has its tokens, else no reasoning)."""

    def __init__(self, tokenizer: Tokenizer, reasoning_parser: str | None) -> None:
        check_reasoning_parser(reasoning_parser)
        self._tokenizer = tokenizer
        self._parser = reasoning_parser
        self._harmony = uses_harmony(reasoning_parser, None, tokenizer.added_token_id)

    def read(self, outputs) -> None:
        """Set each completion's `reasoning_content` and `content` (``outputs``: the
        `RequestOutput`s of chat prompts), where the model reasons."""
        for output in outputs:
            new_reader = self._reader_for(output.prompt_token_ids)
            if new_reader is None:
                continue
            for completion in output.outputs:
                text = completion.text
                if self._harmony:
                    text = self._tokenizer.decode(completion.token_ids, skip_special_tokens=False)
                reply = read_reply(new_reader(), text)
                completion.reasoning_content, completion.content = reply.reasoning, reply.content

    def _reader_for(self, prompt_ids: list[int]) -> Callable[[], ReplyReader] | None:
        if self._harmony:
            return lambda: HarmonyReader(read_calls=False)
        tags = prompt_think_tags(self._parser, prompt_ids, self._tokenizer.decode)
        return None if tags is None else (lambda: ThinkReader(tags))
