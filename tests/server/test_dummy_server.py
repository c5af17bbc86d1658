"""`ember serve DIR --load-format dummy` of a folder holding only a config and tokenizer: the
front end and the engine read no weight file, and the reply is the offline `LLM`'s on the same
seeded dummy weights."""

from __future__ import annotations

import pytest

from ember import LLM, SamplingParams
from ember.bench.make_model import make_model

from .server_process import ServerProcess

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("dummy") / "tiny", config_only=True)


@pytest.fixture(scope="module")
def server(model_dir):
    flags = ("--load-format", "dummy", "--max-model-len", "256", "--num-gpu-blocks-override", "64")
    process = ServerProcess(str(model_dir), *flags, "--served-model-name", "dummy").start()
    yield process
    process.kill()


def test_a_completion_on_dummy_weights_is_the_offline_one(server, model_dir):
    """The same tokens, and the same logprobs of the runners-up: the server's engine made the
    weights the offline `LLM` makes from the same seed (a random model with tied embeddings
    repeats its last token, so the tokens alone would say little)."""
    reply = server.client().completions.create(
        model="dummy",
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    offline = (
        LLM(str(model_dir), load_format="dummy", device="cpu", max_model_len=256)
        .generate(
            [PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
        )[0]
        .outputs[0]
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 4
    assert choice.text == offline.text
    for served, ours in zip(choice.logprobs.top_logprobs, offline.logprobs, strict=True):
        theirs = sorted(logprob for _, logprob in ours.top)
        assert sorted(served.values()) == pytest.approx(theirs, rel=1e-4, abs=1e-4)
        assert min(theirs) < -1  # the runners-up are far below: values the weights decide
