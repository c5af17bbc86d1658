"""gpt-oss's chat format ("harmony") renders as transformers renders it: a template written in
the style of the one gpt-oss ships, with the Jinja it relies on (recursive macros, namespaces
set inside loops, slices of the message list, `strftime_now`, `raise_exception`, `tojson`,
tests such as `is defined` and `is mapping`), and the reasoning of earlier turns, which
reaches the template as ``thinking``."""

from __future__ import annotations

import pytest

from ember.tokenizer.chat_template import ChatTemplate

transformers = pytest.importorskip("transformers")

HARMONY_STYLE = """
{%- macro schema_type(spec) -%}
    {%- if spec.type == "array" -%}{{- schema_type(spec["items"]) + "[]" -}}
    {%- elif spec.type == "object" and spec.properties is mapping -%}
        {{- "{" -}}
        {%- for name, inner in spec.properties.items() -%}
            {{- name -}}{%- if name not in (spec.required or []) -%}?{%- endif -%}: {{ schema_type(inner) }}
            {%- if not loop.last %}, {% endif -%}
        {%- endfor -%}
        {{- "}" -}}
    {%- elif spec.enum is defined -%}{{- '"' + spec.enum | join('" | "') + '"' -}}
    {%- else -%}{{- spec.type | default("any") -}}
    {%- endif -%}
{%- endmacro -%}
{{- "<|start|>system<|message|>Knowledge cutoff: 2024-06\\nCurrent date: " + strftime_now("%Y-%m-%d") -}}
{{- "\\n\\nReasoning: " + (reasoning_effort if reasoning_effort is defined else "medium") -}}
{{- "\\n\\n# Valid channels: analysis, commentary, final.<|end|>" -}}
{%- if messages[0].role in ("system", "developer") -%}
    {%- set instructions = messages[0].content -%}{%- set turns = messages[1:] -%}
{%- else -%}
    {%- set instructions = "" -%}{%- set turns = messages -%}
{%- endif -%}
{%- if instructions or tools -%}
    {{- "<|start|>developer<|message|>" -}}
    {%- if instructions -%}{{- "# Instructions\\n\\n" + instructions -}}{%- endif -%}
    {%- for tool in tools or [] -%}
        {%- set fn = tool.function -%}
        {{- "\\n// " + fn.description + "\\ntype " + fn.name + " = (_: " + schema_type(fn.parameters) + ") => any;" -}}
    {%- endfor -%}
    {{- "<|end|>" -}}
{%- endif -%}
{%- set last_call = namespace(name=none) -%}
{%- for message in turns -%}
    {%- if message.role == "assistant" -%}
        {%- if "<|channel|>" in (message.content or "") -%}
            {{- raise_exception("pass the analysis in 'thinking', not channel tags in content") -}}
        {%- endif -%}
        {%- set later = namespace(final=false) -%}
        {%- for next_message in turns[loop.index:] -%}
            {%- if next_message.role == "assistant" and "tool_calls" not in next_message -%}
                {%- set later.final = true -%}
            {%- endif -%}
        {%- endfor -%}
        {%- if message.thinking is defined and message.thinking and not later.final -%}
            {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" -}}
        {%- endif -%}
        {%- if "tool_calls" in message -%}
            {%- set call = message.tool_calls[0].function -%}
            {{- "<|start|>assistant to=functions." + call.name + "<|channel|>commentary json<|message|>" -}}
            {{- call.arguments | tojson + "<|call|>" -}}
            {%- set last_call.name = call.name -%}
        {%- else -%}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" -}}
        {%- endif -%}
    {%- elif message.role == "tool" -%}
        {%- if last_call.name is none -%}{{- raise_exception("a tool result before any call") -}}{%- endif -%}
        {{- "<|start|>functions." + last_call.name + " to=assistant<|channel|>commentary<|message|>" -}}
        {{- message.content | tojson + "<|end|>" -}}
    {%- else -%}
        {{- "<|start|>" + message.role + "<|message|>" + message.content + "<|end|>" -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|start|>assistant" -}}{%- endif -%}
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "array", "items": {"type": "integer"}},
            },
            "required": ["city"],
        },
    },
}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hi"}],
    "instructions": [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Salut !", "reasoning_content": "French, briefly."},
        {"role": "user", "content": "Ça va ?"},
    ],
    "tool-call": [
        {"role": "user", "content": "Weather in Oslo? Ünïcode ✓"},
        {"role": "assistant", "content": "", "thinking": "Call the tool.", "tool_calls": [CALL]},
        {"role": "tool", "content": '{"temp": -3}'},
    ],
}


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("effort", [None, "high"])
def test_renders_as_transformers_renders(name, effort):
    from transformers.utils.chat_template_utils import render_jinja_template

    extra = {} if effort is None else {"reasoning_effort": effort}
    tools = [WEATHER] if name == "tool-call" else None
    conversation = CONVERSATIONS[name]
    (expected,), _ = render_jinja_template(
        [conversation],
        tools=tools,
        chat_template=HARMONY_STYLE,
        add_generation_prompt=True,
        **extra,
    )
    ours = ChatTemplate(HARMONY_STYLE).render(conversation, tools=tools, **extra)
    assert ours == expected
    assert ours.endswith("<|start|>assistant")


def test_earlier_reasoning_reaches_the_template_as_thinking():
    rendered = ChatTemplate(HARMONY_STYLE).render(CONVERSATIONS["tool-call"])
    assert "<|channel|>analysis<|message|>Call the tool.<|end|>" in rendered
    assert '<|message|>{"city": "Oslo"}<|call|>' in rendered


def test_channel_tags_in_content_are_refused_by_the_template():
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<|channel|>final<|message|>Hello"},
    ]
    with pytest.raises(ValueError, match="channel tags in content"):
        ChatTemplate(HARMONY_STYLE).render(conversation)
