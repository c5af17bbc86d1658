"""Tools, earlier calls and tool results rendered through Llama 3.1- and Qwen2.5-style chat
templates as the chat endpoint hands them over (arguments as objects, as those templates
write `arguments | tojson`)."""

from __future__ import annotations

import json

from .fake_server import chat_client
from .templates import LLAMA3_TEMPLATE, QWEN25_TEMPLATE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": ["string", "null"]}}},
        "x-vendor": None,  # kept: a template shows the tool as the client sent it
    },
}
ARGS = {"city": "Zürich"}
CONVERSATION = [
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(ARGS)},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


def rendered(template: str, **body) -> str:
    client, tokenizer, _ = chat_client(template, "ok")
    response = client.post("/v1/chat/completions", json={"messages": CONVERSATION, **body})
    assert response.status_code == 200, response.text
    return tokenizer.rendered[0]


def test_qwen_renders_tools_the_call_and_its_result():
    prompt = rendered(QWEN25_TEMPLATE, tools=[WEATHER])
    tools = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert json.loads(tools) == WEATHER  # the tool exactly as sent
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
    assert "<|im_start|>assistant\n" + call + "<|im_end|>" in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_llama3_renders_tools_in_the_first_user_turn_the_call_and_its_result():
    prompt = rendered(LLAMA3_TEMPLATE, tools=[WEATHER])
    assert "Environment: ipython" in prompt
    assert json.dumps(WEATHER, indent=4) in prompt and "Weather in Zürich?<|eot_id|>" in prompt
    call = '{"name": "get_weather", "parameters": {"city": "Zürich"}}<|eot_id|>'
    assert "<|start_header_id|>assistant<|end_header_id|>\n\n" + call in prompt
    # Llama's template writes a tool's content through tojson: a string result is quoted.
    result = json.dumps('{"temp": 21}')
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n" + result + "<|eot_id|>" in prompt


def test_without_tools_the_templates_render_no_tool_section():
    assert "<tools>" not in rendered(QWEN25_TEMPLATE)
    assert "Environment: ipython" not in rendered(
        LLAMA3_TEMPLATE, tools=[WEATHER], tool_choice="none"
    )


def test_arguments_that_are_not_a_json_object_stay_text():
    client, tokenizer, _ = chat_client(QWEN25_TEMPLATE, "ok")
    messages = [dict(CONVERSATION[0]), {**CONVERSATION[1]}, CONVERSATION[2]]
    messages[1]["tool_calls"] = [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}
    ]
    assert client.post("/v1/chat/completions", json={"messages": messages}).status_code == 200
    assert '"arguments": "not json"}' in tokenizer.rendered[0]


def test_a_malformed_earlier_call_is_a_400_naming_it():
    client, _, _ = chat_client(QWEN25_TEMPLATE, "ok")
    messages = [CONVERSATION[0], {"role": "assistant", "tool_calls": [{"function": {}}]}]
    response = client.post("/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 400
    assert response.json()["error"]["param"].startswith("messages.1.tool_calls.0.function")
