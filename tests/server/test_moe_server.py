"""`ember serve` of a tiny mixture-of-experts checkpoint (Mixtral) answers a chat completion with
the reply the offline `LLM` gives."""

from __future__ import annotations

import pytest
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams

from .server_process import ServerProcess

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("MixtralForCausalLM", tmp_path_factory.mktemp("mixtral"), seed=9)


@pytest.fixture(scope="module")
def server(model_dir):
    flags = ("--max-model-len", "256", "--num-gpu-blocks-override", "64")
    process = ServerProcess(str(model_dir), *flags, "--served-model-name", "moe").start()
    yield process
    process.kill()


def test_a_chat_completion_is_the_offline_reply(server, model_dir):
    reply = server.client().chat.completions.create(
        model="moe", messages=MESSAGES, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    offline = LLM(str(model_dir), device="cpu", max_model_len=256).chat(
        MESSAGES, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    assert reply.model == "moe"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 6
    assert reply.choices[0].message.content == offline[0].outputs[0].text != ""
