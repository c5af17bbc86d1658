"""The front end's routes that need no engine, on an app built in this process (its lifespan,
which starts the engine, never runs): `GET /v1/models/{id}`, `/v1/embeddings`, CORS headers
and request logging. The live server's list and control endpoints are in
test_multi_model_server.py."""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient

from ember.config import engine_config
from ember.server.app import build_app
from ember.server.config import CorsConfig, ServedModelSpec, ServerConfig

ORIGIN = "https://ui.example"


def app_client(**config) -> TestClient:
    models = (
        ServedModelSpec(engine_config("/models/llama", served_model_name="llama"), aliases=("l8",)),
        ServedModelSpec(engine_config("org/qwen", served_model_name="org/qwen")),
    )
    return TestClient(build_app(ServerConfig(models=models, **config), []))


@pytest.fixture
def app() -> TestClient:
    return app_client()


@pytest.mark.parametrize("name", ["llama", "l8", "org/qwen"])
def test_retrieve_answers_the_object_the_list_holds(app, name):
    listed = {m["id"]: m for m in app.get("/v1/models").json()["data"]}
    reply = app.get(f"/v1/models/{name}")
    assert reply.status_code == 200
    assert reply.json() == listed[name]
    assert reply.json()["object"] == "model" and "state" in reply.json()["ember"]


def test_retrieve_by_an_alias_names_its_model_as_parent(app):
    model = app.get("/v1/models/l8").json()
    assert (model["id"], model["parent"], model["root"]) == ("l8", "llama", "/models/llama")


def test_retrieve_of_an_unknown_model_is_a_404_in_openai_error_json(app):
    reply = app.get("/v1/models/gpt-4")
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "gpt-4" in error["message"] and "llama" in error["message"]


def test_retrieve_needs_the_api_key_like_the_list():
    client = app_client(api_key="secret")
    assert client.get("/v1/models/llama").status_code == 401
    authorized = client.get("/v1/models/llama", headers={"Authorization": "Bearer secret"})
    assert authorized.status_code == 200


def test_embeddings_are_a_404_saying_they_are_not_served(app):
    reply = app.post("/v1/embeddings", json={"model": "llama", "input": "hi"})
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["code"] == "embeddings_not_supported" and "embeddings" in error["message"]


def test_no_cors_headers_unless_configured(app):
    reply = app.get("/v1/models", headers={"Origin": ORIGIN})
    assert reply.status_code == 200
    assert "access-control-allow-origin" not in reply.headers
    preflight = app.options(
        "/v1/chat/completions",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in preflight.headers


def test_cors_answers_preflight_and_marks_responses_when_configured():
    cors = CorsConfig(allowed_origins=(ORIGIN,), allowed_methods=("GET", "POST"))
    client = app_client(cors=cors, api_key="secret")
    # A preflight carries no key: CORS answers it before the key is checked.
    preflight = client.options(
        "/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    # A 401 carries them too, so the page can read why.
    denied = client.get("/v1/models", headers={"Origin": ORIGIN})
    assert denied.status_code == 401
    assert denied.headers["access-control-allow-origin"] == ORIGIN
    other = client.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_requests_are_logged_only_when_enabled(caplog):
    body = {"model": "nope", "prompt": "secret prompt\nsecond line"}
    with caplog.at_level(logging.INFO, logger="ember.server.request_log"):
        app_client().post("/v1/completions", json=body)
        assert not caplog.records
        app_client(log_requests=True).post("/v1/completions", json=body)
    (record,) = caplog.records
    line = record.getMessage()
    assert "POST /v1/completions" in line and "secret prompt" in line
    assert "\n" not in line  # escaped: a body cannot forge a log line


@pytest.mark.slow
def test_the_openai_client_retrieves_a_loaded_model_from_a_live_server(client, model_name):
    """The live server (tests/server/conftest.py): the object carries the engine's state."""
    model = client.models.retrieve(model_name)
    assert model.id == model_name and model.object == "model"
    assert model.max_model_len == 1024 and model.ember["state"] == "loaded"
