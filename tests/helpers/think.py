"""A tokenizer for Qwen3-style reasoning replies: every byte its own token, plus `<think>`,
`</think>`, `<tool_call>`, `</tool_call>` and the ChatML markers as one token each (as Qwen3's
vocabulary has them), and a chat template cut down from Qwen3's: a generation prompt that
leaves thinking to the model, or closes an empty block with ``enable_thinking=False``; or, with
``opens_thinking``, opens the block itself (Qwen3's thinking-only releases, DeepSeek-R1)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from ember.tokenizer.tokenizer import Tokenizer

# Added tokens, as Qwen3's tokenizer.json has them: the think and tool-call tags are not
# special (they stay in text decoded with skip_special_tokens).
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]
TAG_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

QWEN3_TEMPLATE = """
{%- if tools %}<|im_start|>system
# Tools
<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>
For each call, return <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" %}<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% elif opens_thinking %}<think>
{% endif %}
{%- endif %}"""


def think_tokenizer(template: str = QWEN3_TEMPLATE) -> Tokenizer:
    """Byte-level tokens plus Qwen3's tags and ChatML markers; EOS `<|im_end|>`."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    backend.add_tokens(TAG_TOKENS)
    config = {"eos_token": "<|im_end|>", "chat_template": template}
    return Tokenizer(backend, config)


def think_template(opens_thinking: bool) -> str:
    """The template, its generation prompt opening the `<think>` block or not."""
    return (
        "{%- set opens_thinking = "
        + ("true" if opens_thinking else "false")
        + " %}"
        + (QWEN3_TEMPLATE)
    )


def make_think_model(out_dir: Path) -> Path:
    """A tiny random Llama (`helpers.tiny_models`) whose vocabulary adds `<think>` and
    `</think>` after SmolLM2's ids, as tokens of its tokenizer (ids 49152 and 49153)."""
    import tokenizers

    from helpers.tiny_models import SMOLLM2_VOCAB_SIZE, make_tiny_model

    path = make_tiny_model("LlamaForCausalLM", out_dir, vocab_size=SMOLLM2_VOCAB_SIZE + 8)
    tokenizer = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save(str(path / "tokenizer.json"))
    return path
