"""Every bad input gets its status code and an OpenAI error JSON, and the server stays up."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow


def assert_error(reply: httpx.Response, status: int, param: str | None = None) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.fixture(autouse=True)
def server_stays_up(server):
    yield
    assert httpx.get(server.base_url + "/health").status_code == 200


@pytest.fixture(scope="module", autouse=True)
def server_still_generates(server, model_name):
    yield
    out = server.client().completions.create(
        model=model_name, prompt="Hi", max_tokens=2, temperature=0
    )
    assert out.usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("n", 0),
        ("max_tokens", 0),
        ("presence_penalty", 3),
        ("logprobs", 50),
        ("min_tokens", 100),
        ("seed", -5),
        ("stop_token_ids", [10**9]),
        ("logit_bias", {"not-a-token": 1}),
        ("logit_bias", {"5": 500}),
        ("temperature", "hot"),
    ],
)
def test_invalid_parameter_is_400(http, model_name, field, value):
    body = {"model": model_name, "prompt": "Hi", "max_tokens": 4, field: value}
    error = assert_error(http.post("/v1/completions", json=body), 400)
    assert field in (error["param"] or "") or field in error["message"]
    assert error["type"] == "invalid_request_error"


def test_chat_parameter_errors(http, model_name):
    base = {"model": model_name, "messages": [{"role": "user", "content": "Hi"}]}
    assert_error(http.post("/v1/chat/completions", json={**base, "top_logprobs": 2}), 400)
    assert_error(http.post("/v1/chat/completions", json={**base, "messages": []}), 400)
    assert_error(http.post("/v1/chat/completions", json={"model": model_name}), 400, "messages")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    error = assert_error(
        http.post("/v1/chat/completions", json={**base, "messages": image}),
        400,
        "messages.0.content",
    )
    assert "vision tower" in error["message"]


def test_malformed_json_is_400(http):
    reply = http.post(
        "/v1/completions",
        content=b'{"prompt": "Hi", ',
        headers={"content-type": "application/json"},
    )
    assert assert_error(reply, 400)["code"] == "invalid_json"


def test_empty_and_out_of_vocabulary_prompts_are_400(http, model_name):
    for prompt in ("", [], [[]], [10**9]):
        body = {"model": model_name, "prompt": prompt, "max_tokens": 2}
        assert_error(http.post("/v1/completions", json=body), 400)


def test_prompt_longer_than_the_context_is_400(http, model_name):
    long_prompt = "hello " * 1500  # > 1024 tokens, < the 64 KiB body limit
    reply = http.post(
        "/v1/completions", json={"model": model_name, "prompt": long_prompt, "max_tokens": 4}
    )
    assert assert_error(reply, 400)["code"] == "context_length_exceeded"
    chat = {"model": model_name, "messages": [{"role": "user", "content": long_prompt}]}
    assert_error(http.post("/v1/chat/completions", json=chat), 400, "messages")


def test_prompt_plus_max_tokens_over_the_context_is_400(http, model_name):
    body = {"model": model_name, "prompt": "Hi", "max_tokens": 5000}
    assert_error(http.post("/v1/completions", json=body), 400, "max_tokens")


def test_unknown_model_is_404(client, http):
    reply = http.post("/v1/completions", json={"model": "no-such-model", "prompt": "Hi"})
    assert assert_error(reply, 404, "model")["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "Hi"}]
        )


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/version"),
    ],
)
def test_missing_or_wrong_api_key_is_401(server, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        reply = httpx.request(method, server.base_url + path, headers=headers, json={})
        assert assert_error(reply, 401)["code"] == "invalid_api_key"


def test_wrong_key_through_the_client(server):
    wrong = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_health_and_metrics_need_no_key(server):
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/metrics").status_code == 200


def test_body_over_the_limit_is_413(http, model_name):
    body = {"model": model_name, "prompt": "x" * 70_000}
    assert_error(http.post("/v1/completions", json=body), 413)


def test_chunked_body_over_the_limit_is_413(http):
    def chunks():
        for _ in range(20):
            yield b"x" * 8192

    reply = http.post("/v1/completions", content=chunks())
    assert_error(reply, 413)


def test_unknown_route_is_404_json(http):
    assert_error(http.get("/v1/nothing-here"), 404)
