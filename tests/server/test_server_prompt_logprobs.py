"""Prompt logprobs through `ember serve` on a tiny random model (CPU): /v1/completions with
`echo` and `logprobs` scores the prompt as transformers does, whole and streamed; `max_tokens:
0` with `echo` scores it without generating (as lm-evaluation-harness asks); vLLM's
`prompt_logprobs` field comes back in vLLM's shape."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from helpers.hf_reference import prompt_log_softmax
from helpers.tiny_models import make_tiny_model

from .server_process import ServerProcess

pytestmark = pytest.mark.slow

PROMPT = [5, 9, 14, 3, 77, 21, 8, 90, 4, 1, 2, 3, 300, 41, 99, 12]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_model("Qwen2ForCausalLM", tmp_path_factory.mktemp("served-lp"), seed=5)


@pytest.fixture(scope="module")
def reference(model_path) -> torch.Tensor:
    return prompt_log_softmax(model_path, PROMPT)


@pytest.fixture(scope="module")
def http(model_path):
    # A step budget under the prompt's length: the prompt is scored in chunks.
    flags = ("--max-model-len", "128", "--max-num-batched-tokens", "8", "--max-num-seqs", "4")
    server = ServerProcess(str(model_path), *flags, api_key=None).start()
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            yield client
    finally:
        server.kill()


def complete(http, **fields) -> dict:
    reply = http.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()


def assert_prompt_part(logprobs: dict, reference: torch.Tensor, top: int) -> None:
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"][0] == 0
    for j in range(1, len(PROMPT)):
        expected = reference[j - 1, PROMPT[j]].item()
        assert logprobs["token_logprobs"][j] == pytest.approx(expected, abs=TOLERANCE)
        alternatives = logprobs["top_logprobs"][j]
        assert logprobs["tokens"][j] in alternatives
        assert top <= len(alternatives) <= top + 1
        best = reference[j - 1].max().item()
        assert max(alternatives.values()) == pytest.approx(best, abs=TOLERANCE)


def test_echo_with_max_tokens_zero_scores_the_prompt(http, reference):
    body = complete(http, echo=True, logprobs=2, max_tokens=0)
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(PROMPT)
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert_prompt_part(logprobs, reference, top=2)


def test_echo_with_generation_covers_the_prompt_then_the_completion(http, reference):
    body = complete(http, echo=True, logprobs=1, max_tokens=3, ignore_eos=True)
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(PROMPT) + 3
    assert_prompt_part(logprobs, reference, top=1)
    assert all(lp is not None for lp in logprobs["token_logprobs"][len(PROMPT) :])
    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets)


def test_streamed_echo_carries_the_prompt_logprobs(http, reference):
    fields = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 2, "stream": True}
    chunks = []
    with http.stream("POST", "/v1/completions", json={**fields, "ignore_eos": True}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :])["choices"][0])
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for key in merged:
            merged[key] += (chunk["logprobs"] or {}).get(key, [])
    assert len(merged["tokens"]) == len(PROMPT) + 2
    assert_prompt_part(merged, reference, top=2)


def test_vllm_prompt_logprobs_field(http, reference):
    body = complete(http, prompt_logprobs=2, max_tokens=1)
    entries = body["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(PROMPT) and entries[0] is None
    for j in range(1, len(PROMPT)):
        token = entries[j][str(PROMPT[j])]
        expected = reference[j - 1, PROMPT[j]].item()
        assert token["logprob"] == pytest.approx(expected, abs=TOLERANCE)
        assert token["rank"] == int((reference[j - 1] > reference[j - 1, PROMPT[j]]).sum()) + 1
        assert isinstance(token["decoded_token"], str)
        top_ids = reference[j - 1].topk(2).indices.tolist()
        assert set(entries[j]) == {str(t) for t in [PROMPT[j], *top_ids]}
        for rank, token_id in enumerate(top_ids, start=1):
            assert entries[j][str(token_id)]["rank"] == rank or token_id == PROMPT[j]
    assert body["choices"][0]["logprobs"] is None


def test_max_tokens_zero_without_echo_is_refused(http):
    reply = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "max_tokens"
