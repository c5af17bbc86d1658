"""The endpoints around generation: models, health, metrics, version, tokenize, detokenize."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow

METRIC_NAMES = (
    "ember:num_requests_running",
    "ember:num_requests_waiting",
    "ember:kv_cache_usage_perc",
    "ember:kv_cache_blocks_used",
    "ember:prompt_tokens_total",
    "ember:generation_tokens_total",
    "ember:num_preemptions_total",
    "ember:engine_steps_total",
    "ember:scheduled_tokens_total",
    "ember:prefix_cache_queries_total",
    "ember:prefix_cache_hits_total",
    "engine_python_gc_collections_total",
    "engine_python_gc_pause_seconds_total",
    "ember:time_to_first_token_seconds_bucket",
    "ember:time_per_output_token_seconds_bucket",
    "ember:e2e_request_latency_seconds_bucket",
)


def test_models_lists_the_served_model(client, model_name):
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]
    assert models[0].object == "model" and models[0].owned_by == "ember"
    assert models[0].model_extra["max_model_len"] == 1024


def test_health_needs_no_key(server):
    reply = httpx.get(server.base_url + "/health")
    assert reply.status_code == 200


def test_version(http):
    from ember import __version__

    assert http.get("/version").json() == {"version": __version__}


def test_metrics_change_after_requests(server, client, model_name):
    before = server.metrics()
    for name in METRIC_NAMES:
        assert any(key.split("{")[0] == name for key in before), name
    assert all('model_name="' in k for k in before if k.startswith("ember:"))
    client.completions.create(model=model_name, prompt="Hello", max_tokens=3, temperature=0)
    after = server.metrics()

    def total(samples, name):
        return sum(v for k, v in samples.items() if k.split("{")[0] == name)

    assert total(after, "ember:generation_tokens_total") == (
        total(before, "ember:generation_tokens_total") + 3
    )
    assert total(after, "ember:prompt_tokens_total") > total(before, "ember:prompt_tokens_total")
    for name in (
        "ember:time_to_first_token_seconds_count",
        "ember:e2e_request_latency_seconds_count",
        "ember:time_per_output_token_seconds_count",
    ):
        assert total(after, name) == total(before, name) + 1, name


def test_metrics_count_the_engine_steps_by_kind(server, client, model_name):
    """A 3-token completion adds its prompt's tokens and a step with them, then decodes; the
    engine's counters reach the front end with its stats (every ~0.5 s, and when it idles)."""
    import time

    def counts(samples):
        found = {}
        for key, value in samples.items():
            name = key.split("{")[0]
            if name in ("ember:engine_steps_total", "ember:scheduled_tokens_total"):
                found[(name, key.split('kind="')[1].split('"')[0])] = value
        return found

    before = counts(server.metrics())
    assert len(before) == 4
    reply = client.completions.create(
        model=model_name, prompt="Hello there", max_tokens=3, temperature=0
    )
    deadline, after = time.monotonic() + 5, before
    while time.monotonic() < deadline:  # until the counts have moved and settled
        time.sleep(0.3)
        latest = counts(server.metrics())
        if latest == after != before:
            break
        after = latest
    added = {key: after[key] - before[key] for key in before}
    assert added[("ember:scheduled_tokens_total", "prefill")] == reply.usage.prompt_tokens
    assert added[("ember:engine_steps_total", "with_prefill")] == 1
    # The two tokens after the first are decodes (with CPU/GPU overlap, a decode may be
    # scheduled for a token that the end of the request makes unneeded).
    assert added[("ember:scheduled_tokens_total", "decode")] >= 2
    assert added[("ember:engine_steps_total", "decode_only")] >= 2


def test_a_repeated_prompt_is_served_from_the_prefix_cache(server, client, model_name):
    import time

    def cache_counts():
        samples = server.metrics()
        return tuple(
            sum(v for k, v in samples.items() if k.split("{")[0] == name)
            for name in ("ember:prefix_cache_queries_total", "ember:prefix_cache_hits_total")
        )

    prompt = "A long shared system prompt about the weather in several cities. " * 6
    first = client.completions.create(model=model_name, prompt=prompt, max_tokens=2)
    before = cache_counts()
    again = client.completions.create(model=model_name, prompt=prompt, max_tokens=2)
    deadline, after = time.monotonic() + 5, before
    while after == before and time.monotonic() < deadline:  # stats come every ~0.5 s
        time.sleep(0.3)
        after = cache_counts()
    queries, hits = after[0] - before[0], after[1] - before[1]
    assert queries == again.usage.prompt_tokens == first.usage.prompt_tokens
    # Every full block but the one holding the last prompt token.
    assert queries - 16 <= hits < queries


def test_tokenize_and_detokenize_round_trip(http, model_name):
    text = "Hello, world! Ünïcödé"
    tokens = http.post("/tokenize", json={"model": model_name, "prompt": text}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == 1024
    back = http.post("/detokenize", json={"model": model_name, "tokens": tokens["tokens"]})
    assert back.json() == {"prompt": text}


def test_tokenize_chat_messages(http, model_name):
    reply = http.post(
        "/tokenize",
        json={"model": model_name, "messages": [{"role": "user", "content": "Hi"}]},
    ).json()
    plain = http.post("/tokenize", json={"model": model_name, "prompt": "Hi"}).json()
    assert reply["count"] > plain["count"]  # the template adds the turn markers
