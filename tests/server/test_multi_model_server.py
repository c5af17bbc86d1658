"""Several models in one `ember serve` (front end + engine process, on the CPU): two tiny models
of different architectures and the SmolLM2 GGUF answer interleaved requests as each does alone;
under a budget that holds one, requests alternate them through sleep and wake; a stream running
when its model is put to sleep finishes with the same tokens; a model that fails to load leaves
the others serving; the control endpoints need the API key."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers.tiny_models import make_tiny_model, smollm2_gguf_path
from safetensors.torch import load_file, save_file

from ember.api import Engine
from ember.sampling_params import SamplingParams

from .server_process import API_KEY, ServerProcess

pytestmark = pytest.mark.slow

KV_BYTES = 16 << 20
MAX_TOKENS = 16
PROMPTS = [[5, 9, 14, 3, 77], [21, 8, 90, 4], [1, 2, 3, 4, 5, 6, 7, 8]]
MODEL_OPTIONS = {"max_model_len": 128, "kv_cache_memory_bytes": KV_BYTES}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("served")
    return {
        "llama": str(make_tiny_model("LlamaForCausalLM", root / "llama", seed=11)),
        "qwen": str(make_tiny_model("Qwen3ForCausalLM", root / "qwen", seed=12)),
        "smol": str(smollm2_gguf_path()),
    }


@pytest.fixture(scope="module")
def alone(sources) -> dict[str, list[str]]:
    """Each model's greedy completion of each prompt, served alone in this process."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts = {}
    for name, source in sources.items():
        engine = Engine()
        engine.add_model(name, source, device="cpu", **MODEL_OPTIONS)
        outputs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], params, model=name)
        texts[name] = [o.outputs[0].text for o in outputs]
    return texts


def footprints(sources: dict[str, str], *names: str) -> list[int]:
    """What each model takes from the budget while loaded, as the engine computes it."""
    engine = Engine()
    for name in names:
        engine.add_model(name, sources[name], device="cpu", **MODEL_OPTIONS)
    return [engine.pool.footprint(name) for name in names]


def write_config(path: Path, models: dict[str, str], **engine_wide) -> Path:
    lines = [f"{key} = {value}" for key, value in engine_wide.items()]
    for name, source in models.items():
        lines += [
            "[[models]]",
            f'name = "{name}"',
            f'source = "{source}"',
            'device = "cpu"',
            f"max_model_len = {MODEL_OPTIONS['max_model_len']}",
            f"kv_cache_memory_bytes = {KV_BYTES}",
        ]
    path.write_text("\n".join(lines) + "\n")
    return path


def complete(server: ServerProcess, model: str, prompt: list[int], **extra) -> httpx.Response:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    return httpx.post(
        server.base_url + "/v1/completions", json=body, headers=server.headers, timeout=120
    )


def models_by_id(server: ServerProcess) -> dict[str, dict]:
    reply = httpx.get(server.base_url + "/v1/models", headers=server.headers, timeout=10)
    return {m["id"]: m for m in reply.json()["data"]}


def action(server: ServerProcess, model: str, verb: str, **kwargs) -> httpx.Response:
    headers = kwargs.pop("headers", server.headers)
    return httpx.post(
        f"{server.base_url}/v1/models/{model}/{verb}", headers=headers, timeout=120, **kwargs
    )


@pytest.fixture
def serve(tmp_path):
    started = []

    def start(models: dict[str, str], **engine_wide) -> ServerProcess:
        config = write_config(tmp_path / "models.toml", models, **engine_wide)
        server = ServerProcess("--config", str(config), "--api-key", API_KEY).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


def test_three_models_answer_interleaved_requests_as_each_does_alone(sources, alone, serve):
    server = serve(sources)
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in sources]
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda job: complete(server, job[0], PROMPTS[job[1]]), jobs))
    for (name, i), reply in zip(jobs, replies):
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == alone[name][i], (name, i)
    listed = models_by_id(server)
    assert set(listed) == set(sources)
    assert {m["ember"]["state"] for m in listed.values()} == {"loaded"}
    assert all(m["ember"]["weight_bytes"] > 0 for m in listed.values())
    assert server.metric("ember:kv_cache_blocks_used") == 0  # every block back in its pool


def test_a_budget_for_one_model_alternates_them_with_the_same_answers(sources, alone, serve):
    names = ("llama", "qwen")
    budget = int(max(footprints(sources, *names)) * 1.5)
    server = serve({n: sources[n] for n in names}, memory_budget_bytes=budget)
    for _ in range(2):
        for name in names:
            reply = complete(server, name, PROMPTS[0])
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == alone[name][0]
    listed = models_by_id(server)
    assert listed["llama"]["ember"]["sleeps"] >= 1 and listed["llama"]["ember"]["wakes"] >= 1
    assert listed["qwen"]["ember"]["state"] == "loaded"
    assert listed["llama"]["ember"]["state"] == "sleeping"
    assert listed["llama"]["ember"]["host_bytes"] == listed["llama"]["ember"]["weight_bytes"]
    samples = server.metrics()
    assert samples['ember:model_state{model_name="llama",state="sleeping"}'] == 1
    assert samples['ember:model_transitions_total{action="wake",model_name="llama"}'] >= 1
    assert server.metric("ember:kv_cache_blocks_used") == 0


def _stream_and_sleep(server: ServerProcess, body: dict) -> tuple[str, httpx.Response | None]:
    """Stream ``body``'s completion, putting its model to sleep once some text has come back:
    the text streamed and the sleep's reply."""
    text, slept = "", None
    with httpx.stream(
        "POST", server.base_url + "/v1/completions", json=body, headers=server.headers, timeout=120
    ) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: {"):
                continue
            text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
            if slept is None and len(text) > 10:
                slept = action(server, body["model"], "sleep")  # preempts the stream's request
    return text, slept


def test_a_stream_running_when_its_model_sleeps_finishes_with_the_same_tokens(
    sources, alone, serve
):
    server = serve({"llama": sources["llama"]})
    long = 100
    expected = complete(server, "llama", PROMPTS[2], max_tokens=long).json()["choices"][0]["text"]
    body = {
        "model": "llama",
        "prompt": PROMPTS[2],
        "max_tokens": long,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    # On a loaded machine the request can finish before the sleep lands (then nothing woke the
    # model): wake it and try again, until a sleep has preempted the stream.
    for _ in range(5):
        wakes = models_by_id(server)["llama"]["ember"]["wakes"]
        text, slept = _stream_and_sleep(server, body)
        assert slept is not None and slept.status_code == 200, slept.text if slept else None
        assert slept.json()["state"] == "sleeping" and slept.json()["seconds"] >= 0
        assert text == expected  # resumed after the wake that its waiting request caused
        if models_by_id(server)["llama"]["ember"]["wakes"] > wakes:
            break
        assert action(server, "llama", "wake").status_code == 200
    else:
        pytest.fail("every stream finished before its model's sleep landed")


def test_a_model_that_fails_to_load_leaves_the_others_serving(sources, alone, serve, tmp_path):
    broken = make_tiny_model("LlamaForCausalLM", tmp_path / "broken", seed=13)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.0.self_attn.o_proj.weight"]
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    server = serve({"llama": sources["llama"], "broken": str(broken)})
    reply = complete(server, "broken", PROMPTS[0])
    assert reply.status_code == 503, reply.text
    assert "o_proj" in reply.json()["error"]["message"]
    assert models_by_id(server)["broken"]["ember"]["state"] == "failed"
    reply = complete(server, "llama", PROMPTS[0])
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == alone["llama"][0]


def test_a_model_that_cannot_fit_gets_503_with_retry_after(sources, serve):
    (size,) = footprints(sources, "llama")
    server = serve({"llama": sources["llama"]}, memory_budget_bytes=size // 2)
    reply = complete(server, "llama", PROMPTS[0])
    assert reply.status_code == 503, reply.text
    assert "Retry-After" in reply.headers
    assert "GiB" in reply.json()["error"]["message"]


def test_control_endpoints_need_the_api_key_and_report_their_time(sources, serve):
    server = serve({"llama": sources["llama"], "qwen": sources["qwen"]})
    assert action(server, "llama", "sleep", headers={}).status_code == 401
    slept = action(server, "llama", "sleep")
    assert slept.status_code == 200 and slept.json()["state"] == "sleeping"
    assert action(server, "llama", "sleep").status_code == 409
    woke = action(server, "llama", "wake")
    assert woke.status_code == 200 and woke.json()["state"] == "loaded"
    assert woke.json()["seconds"] > 0
    unloaded = action(server, "qwen", "unload")
    assert unloaded.status_code == 200 and unloaded.json()["state"] == "unloaded"
    assert models_by_id(server)["qwen"]["ember"]["device_bytes"] == 0
    loaded = action(server, "qwen", "load")
    assert loaded.status_code == 200 and loaded.json()["state"] == "loaded"
    assert action(server, "nope", "load").status_code == 404
    assert action(server, "/etc/passwd", "load").status_code == 404
