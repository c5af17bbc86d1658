"""How one chat request's replies are written, so that they are read and constrained alike:
gpt-oss's harmony channels, or text that may open with a `<think>` block (a reasoning parser)
and may hold tool calls in a text format (the request's tools).

The reader of a choice (`ReplySyntax.reader`) and the grammar of a constrained request
(`ReplySyntax.constraint`) follow the same structure: where a model reasons, a constraint holds
only the answer after its reasoning (the final channel's message, or what follows
`</think>`), and the reasoning before it is free. The constraint is one grammar of the whole
reply, reasoning first, rather than a grammar switched on once the reasoning ends: llguidance
reads the markers as tokens, the matcher follows every token the request records (so overlap,
preemption and the per-step masks work as for any grammar), and a harmony call's header,
which tool_choice must force, is part of the grammar.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ember.server.errors import BadRequestError
from ember.server.harmony.grammar import final_answer, forced_call
from ember.server.harmony.parser import HarmonyReader
from ember.server.reasoning.selection import prompt_think_tags
from ember.server.reasoning.think import ThinkReader, ThinkTags
from ember.server.reasoning.think_grammar import after_thinking
from ember.server.reply import ReplyReader, ToolCallReader
from ember.server.structured_outputs import check_structured_outputs
from ember.server.tool_calls.request import ToolUse
from ember.structured_output.grammar import constraint_lark
from ember.structured_output.params import StructuredOutputsParams

AddedTokenId = Callable[[str], int | None]


@dataclass(frozen=True)
class ReplySyntax:
    """One request's reply format: ``harmony`` (gpt-oss), else text with ``thinking`` (None:
    the model writes no `<think>` block) before the answer; ``tools``: the request's tool
    calling."""

    tools: ToolUse
    harmony: bool = False
    thinking: ThinkTags | None = None

    @property
    def reads_reasoning(self) -> bool:
        """Whether replies carry reasoning (the response has `reasoning_content`)."""
        return self.harmony or self.thinking is not None

    def reader(self) -> ReplyReader | None:
        """A fresh reader of one choice's reply; None: the reply is content, as written."""
        if self.harmony:
            return HarmonyReader(read_calls=self.tools.template_tools is not None)
        parser = self.tools.parser
        answer = ToolCallReader(parser) if parser is not None else None
        if self.thinking is not None:
            return ThinkReader(self.thinking, answer)
        return answer

    def constraint(
        self, asked: StructuredOutputsParams | None, added_token_id: AddedTokenId
    ) -> StructuredOutputsParams | None:
        """What holds the reply: ``asked`` (the request's checked structured output) or the
        calls tool_choice demands (never both: a 400), on the answer after the reasoning."""
        demanded = self.tools.demands_calls
        if demanded and asked is not None:
            raise BadRequestError(
                "a tool_choice that demands a call constrains the output: it cannot be combined "
                "with response_format or guided decoding",
                param="tool_choice",
            )
        if self.harmony and demanded:  # the call's header is harmony's own: one grammar
            return _checked(forced_call(self.tools.template_tools or [], added_token_id), "tools")
        calls = self.tools.forced_output(added_token_id)
        if calls is not None:
            check_structured_outputs(calls, "tools")  # a tool's parameters may not compile
            return self._after_reasoning(calls, added_token_id, "tools")
        if asked is None:
            return None
        return self._after_reasoning(asked, added_token_id, "response_format")

    def _after_reasoning(
        self, answer: StructuredOutputsParams, added_token_id: AddedTokenId, field: str
    ) -> StructuredOutputsParams:
        """``answer`` held after the reply's reasoning; as it is where replies carry none."""
        if self.harmony:
            grammar = final_answer(constraint_lark(answer), added_token_id)
        elif self.thinking is not None:
            grammar = after_thinking(constraint_lark(answer), self.thinking, added_token_id)
        else:
            return answer
        return _checked(grammar, field)


def reply_syntax(
    tools: ToolUse,
    harmony: bool,
    reasoning_parser: str | None,
    prompt_ids: list[int],
    decode: Callable[..., str],
) -> ReplySyntax:
    """The syntax of replies to the prompt ``prompt_ids``: harmony, or the `<think>` block
    ``reasoning_parser`` reads (where the prompt left it, read by ``decode``, the tokenizer's)."""
    if harmony:
        return ReplySyntax(tools, harmony=True)
    return ReplySyntax(tools, thinking=prompt_think_tags(reasoning_parser, prompt_ids, decode))


def _checked(grammar: str, field: str) -> StructuredOutputsParams:
    """``grammar`` as a constraint, checked (its answer was: a failure here is ember's, named
    after the field the answer came from)."""
    params = StructuredOutputsParams(grammar=grammar)
    check_structured_outputs(params, field)
    return params
