"""The embedded SmolLM2 GGUF, dequantized from its Q4_1 blocks and quantized to FP8 as it loads
(``quantization="fp8"``): it answers the default model's questions, and its perplexity on a
fixed text stays within 2% of the same model unquantized (the figures: bench/results/README.md,
"FP8 accuracy"). The CPU path dequantizes every FP8 weight at every step (seconds a step), so
the answers here are kept to a few tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from ember import LLM, SamplingParams
from ember.chat_prompt import chat_prompt_ids

pytestmark = pytest.mark.slow

PERPLEXITY_MARGIN = 1.02
TEXT = (
    "The water cycle describes how water moves between the oceans, the air and the land. "
    "Heat from the sun warms the surface of the sea, and some of the water evaporates into the "
    "atmosphere as vapour. As the warm, moist air rises, it cools, and the vapour condenses into "
    "tiny droplets that gather as clouds. When the droplets grow heavy enough, they fall back to "
    "the ground as rain or snow. Some of that water soaks into the soil and feeds plants and "
    "underground springs, while the rest runs off into streams and rivers that carry it back to "
    "the sea. Plants also return water to the air through their leaves. Over thousands of years, "
    "this slow and steady movement shapes valleys, fills lakes and keeps life on Earth supplied "
    "with fresh water."
)


def load(**options) -> LLM:
    return LLM(max_model_len=512, kv_cache_memory_bytes=32 << 20, **options)


@pytest.fixture(scope="module")
def fp8_llm():
    return load(quantization="fp8")


def perplexity(llm: LLM, text: str) -> float:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    scored = llm.generate([text], params)[0].prompt_logprobs[1:]
    logprobs = [next(iter(token.values())).logprob for token in scored]
    return math.exp(-sum(logprobs) / len(logprobs))


def test_the_default_model_in_fp8_answers_its_questions(fp8_llm):
    """The completion and the chat of tests/test_default_model.py, in one batch."""
    model = fp8_llm.instance.model
    assert model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat_ids = chat_prompt_ids(fp8_llm.get_tokenizer(), question)
    completion, chat = fp8_llm.generate(
        ["The capital of France is", {"prompt_token_ids": chat_ids}],
        SamplingParams(temperature=0, max_tokens=8),
    )
    assert "Paris" in completion.outputs[0].text
    assert "Paris" in chat.outputs[0].text


def test_its_perplexity_stays_within_two_percent_of_the_unquantized_model(fp8_llm):
    fp8 = perplexity(fp8_llm, TEXT)
    unquantized = perplexity(load(), TEXT)
    print(f"perplexity: unquantized {unquantized:.4f}, fp8 {fp8:.4f}")
    assert unquantized / PERPLEXITY_MARGIN <= fp8 <= unquantized * PERPLEXITY_MARGIN
