"""The embedded SmolLM2 GGUF: loads fast, chats, and generates what transformers generates."""

from __future__ import annotations

import time

import pytest
import torch
from helpers.hf_reference import hf_greedy_tokens

from ember import LLM, SamplingParams
from ember.weights.default_model import default_model_path

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' GGUF loading needs it

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three primary colors:",
]


@pytest.fixture(scope="module")
def llm():
    start = time.perf_counter()
    instance = LLM(max_model_len=512)
    instance.load_seconds = time.perf_counter() - start
    return instance


def test_default_model_loads_and_completes_sensibly(llm):
    params = SamplingParams(max_tokens=16, temperature=0)
    text = llm.generate(["The capital of France is"], params)[0].outputs[0].text
    assert "Paris" in text
    print(f"load took {llm.load_seconds:.1f} s")


def test_chat_template_renders_and_chat_answers(llm):
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert "<|im_start|>user\nHi<|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
    )[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")


def test_greedy_tokens_equal_transformers_gguf_loading(llm):
    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    # Both sides mask EOS for 32 tokens (transformers' min_new_tokens, our min_tokens).
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, ours):
        assert out.outputs[0].token_ids == hf_greedy_tokens(hf, prompt, 32)
    llm.instance.scheduler.check_invariants()


def test_stop_strings_are_cut_from_the_text(llm):
    params = SamplingParams(temperature=0, max_tokens=32, stop=[" Paris"])
    out = llm.generate(["The capital of France is"], params)[0].outputs[0]
    assert " Paris" not in out.text
    assert out.finish_reason == "stop" and out.stop_reason == " Paris"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_params_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_raise_and_the_engine_keeps_serving(llm):
    vocab = llm.instance.model_config.vocab_size
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, vocab + 5]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="context length"):
        llm.generate([[5] * 600], SamplingParams(max_tokens=4))
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))
    assert out[0].outputs[0].token_ids
    llm.instance.scheduler.check_invariants()


def test_n_choices_and_logprobs(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, logprobs=2)
    out = llm.generate(["Hello"], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in c.logprobs)
