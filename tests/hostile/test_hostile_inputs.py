"""Each class of hostile input found against the server, as the attacker sent it: every one is a
400 in OpenAI error JSON naming the parameter, and none reaches the engine (the server is whole
afterwards: conftest.py)."""

from __future__ import annotations

import json
import time

import pytest

from ember.tokenizer.chat_template import RENDER_ARGUMENTS

pytestmark = pytest.mark.slow

ROLES = ("system", "developer", "user", "assistant", "tool")


def post(http, path: str, body: dict):
    """POST `body` as Python's json writes it: NaN and Infinity literals, escaped surrogates."""
    content = json.dumps(body, allow_nan=True)
    return http.post(path, content=content, headers={"Content-Type": "application/json"})


def assert_400(reply, param: str | None) -> dict:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error
    return error


def completion(**fields) -> dict:
    return {"prompt": "Hi", "max_tokens": 2, **fields}


def chat(content="Hi", **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **fields}


# -- 1. integers the engine cannot hold, floats that are not numbers --------------------------


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("seed", 2**63, "seed"),  # the attack: OverflowError in the engine's sampler
        ("seed", 2**64, "seed"),
        ("seed", -1, "seed"),
        ("top_k", 2**31, "top_k"),
        ("top_k", 2**64, "top_k"),
        ("max_tokens", 2**31, "max_tokens"),
        ("max_tokens", 2**64, "max_tokens"),
        ("min_tokens", 2**31, "min_tokens"),
        ("min_tokens", 2**64, "min_tokens"),
        ("n", 2**64, "n"),
        ("logprobs", 2**64, "logprobs"),
        ("stop_token_ids", [2**31], "stop_token_ids"),
        ("stop_token_ids", [2**64], "stop_token_ids"),
        ("logit_bias", {str(2**64): 1}, "logit_bias"),
        ("prompt", [2**64], "prompt"),
        ("prompt", [[1, 2**31]], "prompt"),
    ],
)
def test_integers_beyond_the_engine_are_400(http, field, value, param):
    assert_400(post(http, "/v1/completions", completion(**{field: value, "temperature": 1})), param)


@pytest.mark.parametrize("value", [2**63, 2**64])
def test_chat_seed_beyond_the_engine_is_400(http, value):
    assert_400(post(http, "/v1/chat/completions", chat(seed=value)), "seed")


@pytest.mark.parametrize("value", [2**31, 2**64, -1])
def test_detokenize_ids_beyond_the_vocabulary_are_400(http, value):
    assert_400(post(http, "/detokenize", {"tokens": [1, value]}), "tokens")


def test_largest_seed_serves_every_choice_reproducibly(http):
    """n choices use seed, seed + 1, ...: from the largest seed they wrap to 0, 1, ..."""
    body = completion(seed=2**63 - 1, n=3, temperature=1.5, max_tokens=3, ignore_eos=True)
    replies = [post(http, "/v1/completions", body) for _ in range(2)]
    assert [r.status_code for r in replies] == [200, 200], replies[0].text
    texts = [[choice["text"] for choice in r.json()["choices"]] for r in replies]
    assert len(texts[0]) == 3 and texts[0] == texts[1]


@pytest.mark.parametrize("literal", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(
    "field",
    [
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ],
)
def test_non_finite_floats_are_400(http, field, literal):
    assert_400(post(http, "/v1/completions", completion(**{field: literal})), field)
    assert_400(post(http, "/v1/chat/completions", chat(**{field: literal})), field)


@pytest.mark.parametrize("literal", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logit_bias_is_400(http, literal):
    reply = post(http, "/v1/completions", completion(logit_bias={"42": literal}))
    assert_400(reply, "logit_bias.42")


# -- 2. strings with lone surrogates ------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", completion(prompt="\ud800"), "prompt"),
        ("/v1/completions", completion(prompt=["ok", "a\udfffb"]), "prompt.1"),
        ("/v1/completions", completion(stop="\ud800"), "stop"),
        ("/v1/completions", completion(stop=["ok", "\udc00"]), "stop.1"),
        ("/v1/completions", completion(model="\ud800"), "model"),
        ("/v1/completions", completion(logit_bias={"\ud800": 1}), "logit_bias"),
        ("/v1/chat/completions", chat("\ud800"), "messages.0.content"),
        (
            "/v1/chat/completions",
            chat([{"type": "text", "text": "\ud83d"}]),
            "messages.0.content.0.text",
        ),
        ("/v1/chat/completions", chat(stop=["\ud800"]), "stop.0"),
        (
            "/v1/chat/completions",
            chat(chat_template_kwargs={"x": "\ud800"}),
            "chat_template_kwargs.x",
        ),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages.0.content"),
        ("/tokenize", {"messages": [{"role": "user", "name": "\udfff"}]}, "messages.0.name"),
        ("/v1/completions", completion(**{"\ud800": 1}), None),  # an unknown field's name
    ],
)
def test_lone_surrogates_are_400(http, path, body, param):
    error = assert_400(post(http, path, body), param)
    assert "Unicode" in error["message"]


# -- 3. template variables the renderer sets itself ---------------------------------------------


@pytest.mark.parametrize("name", sorted(RENDER_ARGUMENTS))
def test_chat_template_kwargs_cannot_reuse_the_renderers_names(http, name):
    reply = post(http, "/v1/chat/completions", chat(chat_template_kwargs={name: []}))
    error = assert_400(reply, "chat_template_kwargs")
    assert repr(name) in error["message"]


def test_other_chat_template_kwargs_are_passed(http):
    reply = post(http, "/v1/chat/completions", chat(chat_template_kwargs={"enable_thinking": 0}))
    assert reply.status_code == 200, reply.text


# -- 4. booleans as token ids, chat roles -------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", completion(prompt=[[False]]), "prompt"),
        ("/v1/completions", completion(prompt=[True]), "prompt"),
        ("/v1/completions", completion(prompt=[[1, 2], [True]]), "prompt"),
        ("/v1/completions", completion(stop_token_ids=[True]), "stop_token_ids.0"),
        ("/v1/chat/completions", chat(stop_token_ids=[1, False]), "stop_token_ids.1"),
        ("/detokenize", {"tokens": [True]}, "tokens.0"),
    ],
)
def test_booleans_are_not_token_ids(http, path, body, param):
    assert_400(post(http, path, body), param)


def test_token_ids_that_are_integers_pass(http):
    reply = post(http, "/v1/completions", completion(prompt=[[1, 2], [3]], stop_token_ids=[0]))
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == 2


@pytest.mark.parametrize("role", ROLES)
def test_documented_roles_are_accepted(http, role):
    reply = post(http, "/tokenize", {"messages": [{"role": role, "content": "Hi"}]})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("role", ["function", "hacker", "", "USER", "user\n"])
def test_unknown_roles_are_400(http, role):
    body = {"messages": [{"role": "user", "content": "Hi"}, {"role": role, "content": "x"}]}
    assert_400(post(http, "/tokenize", body), "messages.1.role")
    assert_400(post(http, "/v1/chat/completions", {**body, "max_tokens": 1}), "messages.1.role")


# -- 5. request text in the log -----------------------------------------------------------------


def test_unknown_field_names_cannot_forge_or_flood_log_lines(server, http):
    forged = "2031-01-01 00:00:00,000 ERROR forged by a client"
    long_name = "1" + "y" * 5000
    # Logged in sorted order: these two first, then 8 of the 40 others, then a count.
    fields = {f"0\n{forged}\x1b[31m": 1, long_name: 2, **{f"z{i}": i for i in range(40)}}
    assert post(http, "/v1/completions", completion(**fields)).status_code == 200
    line = wait_for_log_line(server, "ignoring unknown fields")
    assert "\\n" + forged in line  # escaped, on the line of the request
    log = server.log_path.read_text(errors="replace")
    assert "\n" + forged not in log and "\x1b" not in log
    assert f"({len(long_name)} chars)" in line and "y" * 101 not in line
    assert line.endswith("and 32 more") and len(line) < 2000


def wait_for_log_line(server, needle: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = server.log_path.read_text(errors="replace").splitlines()
        found = [line for line in lines if needle in line]
        if found:
            return found[-1]
        time.sleep(0.1)
    raise AssertionError(f"no log line with {needle!r}:\n{server.log()}")


# -- 6. the OpenAPI schema ----------------------------------------------------------------------


def test_openapi_schema_needs_the_key(server):
    import httpx

    assert httpx.get(server.base_url + "/openapi.json").status_code == 401


def test_openapi_schema_describes_the_request_bodies(http):
    reply = http.get("/openapi.json")
    assert reply.status_code == 200
    schema = reply.json()
    components = schema["components"]["schemas"]

    def body_schema(path: str) -> dict:
        content = schema["paths"][path]["post"]["requestBody"]["content"]
        ref = content["application/json"]["schema"]["$ref"]
        return components[ref.rsplit("/", 1)[1]]

    completions = body_schema("/v1/completions")
    assert "prompt" in completions["required"]
    assert {"seed", "max_tokens", "logit_bias", "stop_token_ids"} <= set(completions["properties"])
    chat_body = body_schema("/v1/chat/completions")
    message = components[chat_body["properties"]["messages"]["items"]["$ref"].rsplit("/", 1)[1]]
    assert set(message["properties"]["role"]["enum"]) == set(ROLES)
    assert body_schema("/detokenize")["properties"]["tokens"]["items"]["type"] == "integer"
    assert "prompt" in body_schema("/tokenize")["properties"]
    assert "/openapi.json" not in schema["paths"]
