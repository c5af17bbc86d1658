"""A tokenizer with gpt-oss's harmony special tokens (one token each, as o200k_harmony has them;
every other byte its own token) and a chat template that renders conversations as gpt-oss's
does: its assistant, tool-call and tool-result branches as the published template writes them
(reasoning in ``thinking``, one call per assistant message, results named by the last call),
its system and tool preamble cut short."""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from ember.tokenizer.tokenizer import Tokenizer

HARMONY_SPECIAL_TOKENS = [
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
    "<|endoftext|>",
]

GPT_OSS_TEMPLATE = """
{{- "<|start|>system<|message|>Reasoning: medium\\n\\n# Valid channels: analysis, commentary, final.<|end|>" -}}
{%- if tools -%}
    {{- "<|start|>developer<|message|># Tools\\n\\nnamespace functions {\\n" -}}
    {%- for tool in tools -%}{{- "type " + tool.function.name + " = (_: any) => any;\\n" -}}{%- endfor -%}
    {{- "} // namespace functions<|end|>" -}}
{%- endif -%}
{%- set last_tool_call = namespace(name=none) -%}
{%- for message in messages -%}
    {%- if message.role == 'assistant' -%}
        {%- if "content" in message -%}
            {%- if "<|channel|>analysis<|message|>" in message.content or "<|channel|>final<|message|>" in message.content -%}
                {{- raise_exception("You have passed a message containing <|channel|> tags in the content field.") -}}
            {%- endif -%}
        {%- endif -%}
        {%- if "tool_calls" in message -%}
            {%- set future_final_message = namespace(found=false) -%}
            {%- for future_message in messages[loop.index:] -%}
                {%- if future_message.role == 'assistant' and "tool_calls" not in future_message -%}
                    {%- set future_final_message.found = true -%}
                {%- endif -%}
            {%- endfor -%}
            {%- set tool_call = message.tool_calls[0] -%}
            {%- if tool_call.function -%}{%- set tool_call = tool_call.function -%}{%- endif -%}
            {%- if message.content and message.thinking -%}
                {{- raise_exception("Cannot pass both content and thinking in an assistant message with tool calls!") -}}
            {%- elif message.content and not future_final_message.found -%}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.content + "<|end|>" -}}
            {%- elif message.thinking and not future_final_message.found -%}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" -}}
            {%- endif -%}
            {{- "<|start|>assistant to=" -}}
            {{- "functions." + tool_call.name + "<|channel|>commentary " -}}
            {{- (tool_call.content_type if tool_call.content_type is defined else "json") + "<|message|>" -}}
            {{- tool_call.arguments|tojson -}}
            {{- "<|call|>" -}}
            {%- set last_tool_call.name = tool_call.name -%}
        {%- elif loop.last and not add_generation_prompt -%}
            {%- if "thinking" in message -%}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" -}}
            {%- endif -%}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" -}}
        {%- else -%}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" -}}
            {%- set last_tool_call.name = none -%}
        {%- endif -%}
    {%- elif message.role == 'tool' -%}
        {%- if last_tool_call.name is none -%}
            {{- raise_exception("Message has tool role, but there was no previous assistant message with a tool call!") -}}
        {%- endif -%}
        {{- "<|start|>functions." + last_tool_call.name -}}
        {{- " to=assistant<|channel|>commentary<|message|>" + message.content|tojson + "<|end|>" -}}
    {%- elif message.role == 'user' -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}
"""


def harmony_tokenizer(chat_template: str = GPT_OSS_TEMPLATE) -> Tokenizer:
    """Byte-level tokens plus harmony's special tokens; EOS `<|return|>`, as gpt-oss's."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(HARMONY_SPECIAL_TOKENS)
    config = {"eos_token": "<|return|>", "chat_template": chat_template}
    return Tokenizer(backend, config)


def plain_byte_tokenizer() -> Tokenizer:
    """The same bytes without harmony's tokens (the markers are plain text to it)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, {})
