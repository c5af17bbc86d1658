"""`ember serve MODEL -tp 2` on the CPU, of a dense model and of a mixture of experts: the
engine process starts one worker process (rank 1, its own child), the completion is the
single-process model's, and a sleep of the split model is refused by name (not built yet)."""

from __future__ import annotations

import httpx
import psutil
import pytest
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams

from .server_process import ServerProcess

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
FLAGS = ("--max-model-len", "256", "--num-gpu-blocks-override", "64", "--device", "cpu")


@pytest.fixture(scope="module", params=["Qwen2ForCausalLM", "Qwen3MoeForCausalLM"])
def model_dir(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp("tp") / "m")


@pytest.fixture(scope="module")
def server(model_dir):
    process = ServerProcess(str(model_dir), *FLAGS, "-tp", "2", "--served-model-name", "tp")
    process.start()
    yield process
    process.kill()


def test_a_split_model_answers_as_one_process_does(server, model_dir):
    reply = server.client().completions.create(
        model="tp", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    with LLM(str(model_dir), device="cpu", max_model_len=256) as single:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        expected = single.generate([PROMPT], params)[0].outputs[0].text
    assert reply.choices[0].text == expected and reply.usage.completion_tokens == 8
    front_end = psutil.Process(server.process.pid)
    workers = [
        p for p in front_end.children(recursive=True) if "spawn_main" in " ".join(p.cmdline())
    ]
    assert len(workers) == 2  # the engine, and rank 1 beneath it


def test_sleep_of_a_split_model_is_refused(server):
    reply = httpx.post(f"{server.base_url}/v1/models/tp/sleep", headers=server.headers, timeout=30)
    assert reply.status_code == 409 and "not supported yet" in reply.text
