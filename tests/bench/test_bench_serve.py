"""`ember bench serve` and its transformers peer: request sampling, the figures, a full run against
a stand-in OpenAI server, the launch machinery, and the peer on a tiny random Llama on CPU.

Benchmarks are not tests: nothing here asserts a timing, only that the right things are measured.
Run as a script (`python tests/test_bench_serve.py serve [MODEL] --port N`), this file is the
stand-in server, so the launch machinery can start it like `ember serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import os
import pkgutil
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import pytest
from aiohttp import web

from ember.bench import datasets, launch, serve
from ember.bench.client import RequestResult
from ember.bench.datasets import SampledRequest, is_valid_pair, sample_random, sample_sharegpt
from ember.bench.engine_steps import STEP_MIX_FIELDS, parse_step_counts, step_mix
from ember.bench.stats import full_load_output_throughput, output_tokens_per_second, summarize

pytestmark = pytest.mark.slow  # the benchmarks' tooling: whole runs, not the engine

FAKE_MODEL = "fake-model"

LATENCY_FIELDS = [
    f"{stat}_{metric}_ms"
    for metric in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "p90", "p99")
]
REPORT_FIELDS = [
    "model",
    "base_url",
    "endpoint",
    "dataset",
    "num_prompts",
    "max_concurrency",
    "request_rate",
    "seed",
    "completed",
    "failed",
    "duration_s",
    "request_throughput",
    "output_throughput",
    "full_load_output_throughput",
    "full_load_window_s",
    "total_token_throughput",
    "total_input_tokens",
    "total_output_tokens",
    *LATENCY_FIELDS,
    "server_cpu_seconds",
    "server_cores_busy",
    "server_cpu_seconds_per_1k_output_tokens",
    "gpu_util_mean",
    "gpu_util_max",
    "gpu_mem_used_max_mib",
    "server_command",
    "started_at",
    "output_throughput_per_s",
    *STEP_MIX_FIELDS,
]


# ----------------------------------------------------------------------------- stand-in server


@dataclass
class FakeServerLog:
    """What the stand-in server was asked: generation request bodies, /tokenize calls."""

    bodies: list[dict] = field(default_factory=list)
    tokenize_calls: int = 0


SERVER_LOG = web.AppKey("server_log", FakeServerLog)


def make_fake_openai_app(fail_every: int = 0) -> web.Application:
    """Just enough of the OpenAI streaming API and ember's /tokenize: one "a" per token, a usage
    chunk, [DONE]. A token is a UTF-8 byte, like the byte-level tokenizer below. With
    `fail_every` n, request k (the probe is 0) fails with HTTP 500 when k % n == n - 1."""
    app = web.Application()
    app[SERVER_LOG] = FakeServerLog()

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": FAKE_MODEL}]})

    async def tokenize(request: web.Request) -> web.Response:
        request.app[SERVER_LOG].tokenize_calls += 1
        count = len((await request.json())["prompt"].encode("utf-8"))
        return web.json_response({"tokens": list(range(count)), "count": count})

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies = request.app[SERVER_LOG].bodies
        bodies.append(body)
        if fail_every and len(bodies) % fail_every == 0:
            return web.json_response({"error": "planted failure"}, status=500)
        chat = "messages" in body
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(body["max_tokens"]):
            choice = {"index": 0, "delta": {"content": "a"}} if chat else {"index": 0, "text": "a"}
            await _send_event(response, {"choices": [choice]})
            if i % 8 == 7:
                await asyncio.sleep(0.0005)  # let the other streams interleave
        usage = {
            "prompt_tokens": len(prompt.encode("utf-8")),
            "completion_tokens": body["max_tokens"],
        }
        await _send_event(response, {"choices": [], "usage": usage})
        await response.write(b"data: [DONE]\n\n")
        return response

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    return app


async def _send_event(response: web.StreamResponse, payload: dict) -> None:
    await response.write(f"data: {json.dumps(payload)}\n\n".encode())


class FakeOpenAIServer:
    """The stand-in app on a free localhost port, in a thread with its own event loop."""

    def __init__(self, fail_every: int = 0):
        self.app = make_fake_openai_app(fail_every)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner = web.AppRunner(self.app)
        self.base_url = ""

    def __enter__(self) -> Self:
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    async def _start(self) -> int:
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        return self._runner.addresses[0][1]

    def __exit__(self, *exc_info) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


# ----------------------------------------------------------------------------- fixtures


class WordCounter:
    """A token counter where a token is a whitespace-separated word."""

    def count_tokens(self, texts):
        return [len(text.split()) for text in texts]


@pytest.fixture(scope="module")
def byte_tokenizer_file(tmp_path_factory) -> Path:
    """A byte-level tokenizer.json (one token per UTF-8 byte) with <s> and </s> as 256, 257."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def sharegpt_pairs() -> list[tuple[str, str]]:
    return datasets.load_sharegpt_pairs()


def _run_bench(*flags: str) -> int:
    return serve.main(["--disable-tqdm", *flags])


# ----------------------------------------------------------------------------- datasets


def test_truncated_json_array_keeps_the_complete_items():
    text = '[\n {"a": 1},\n {"a": [2, 3], "b": "x,]"},\n {"a": "cut off mid-str'
    assert list(datasets.iter_complete_json_array_items(text)) == [
        {"a": 1},
        {"a": [2, 3], "b": "x,]"},
    ]
    assert list(datasets.iter_complete_json_array_items('[{"a": 1}, {"a": 2}]')) == [
        {"a": 1},
        {"a": 2},
    ]


def test_packaged_sharegpt_file_parses_up_to_its_last_complete_record(sharegpt_pairs):
    assert len(sharegpt_pairs) > 1000
    assert all(isinstance(p, str) and isinstance(c, str) for p, c in sharegpt_pairs)


def test_valid_pairs_follow_vllms_length_rule():
    assert is_valid_pair(4, 4)
    assert is_valid_pair(1024, 1024)
    assert not is_valid_pair(3, 100)  # prompt too short
    assert not is_valid_pair(100, 3)  # output too short
    assert not is_valid_pair(1025, 4)  # prompt too long
    assert not is_valid_pair(1024, 1025)  # pair too long


def test_sharegpt_sampling_respects_the_length_filters(sharegpt_pairs, byte_tokenizer_file):
    tokenizer = datasets.LocalTokenizer(byte_tokenizer_file)
    sampled = sample_sharegpt(sharegpt_pairs, 200, seed=0, counter=tokenizer)
    assert len(sampled) == 200
    completion_lens: dict[str, set[int]] = {}  # some prompts ("Hello!") open many conversations
    for prompt, completion in sharegpt_pairs:
        completion_lens.setdefault(prompt, set()).add(len(completion.encode("utf-8")))
    for request in sampled:
        assert request.prompt_len == len(request.prompt.encode("utf-8"))
        assert request.output_len in completion_lens[request.prompt]
        assert is_valid_pair(request.prompt_len, request.output_len)


def test_sharegpt_sampling_is_deterministic_by_seed(sharegpt_pairs):
    def draw(seed: int) -> list[SampledRequest]:
        return sample_sharegpt(sharegpt_pairs, 50, seed=seed, counter=WordCounter())

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)
    # Only the order is random: a longer draw starts with the shorter one.
    assert sample_sharegpt(sharegpt_pairs, 80, seed=7, counter=WordCounter())[:50] == draw(7)


def test_random_requests_have_the_asked_lengths():
    sampled = sample_random(5, input_len=32, output_len=16, seed=1, counter=WordCounter())
    assert [(r.prompt_len, r.output_len) for r in sampled] == [(32, 16)] * 5
    assert len({r.prompt for r in sampled}) == 5
    assert sampled == sample_random(5, 32, 16, seed=1, counter=WordCounter())


# ----------------------------------------------------------------------------- figures


def _result(start: float, chunk_times: list[float], tokens: int, prompt_len: int) -> RequestResult:
    return RequestResult(
        success=True,
        prompt_len=prompt_len,
        start_s=start,
        output_tokens=tokens,
        ttft_s=chunk_times[0] - start,
        e2el_s=chunk_times[-1] - start,
        itl_s=[b - a for a, b in itertools.pairwise(chunk_times)],
        chunk_times_s=chunk_times,
    )


def test_summary_figures_on_known_results():
    results = [
        _result(0.0, [0.1, 0.2, 0.4], tokens=3, prompt_len=10),
        _result(1.0, [1.2, 1.3], tokens=2, prompt_len=20),
        RequestResult(success=False, prompt_len=99, start_s=0.0, error="HTTP 500"),
    ]
    figures = summarize(results, duration_s=2.0)
    assert figures["completed"] == 2 and figures["failed"] == 1
    assert figures["total_input_tokens"] == 30 and figures["total_output_tokens"] == 5
    assert figures["request_throughput"] == pytest.approx(1.0)
    assert figures["output_throughput"] == pytest.approx(2.5)
    assert figures["total_token_throughput"] == pytest.approx(17.5)
    assert figures["mean_ttft_ms"] == pytest.approx(150.0)
    assert figures["median_ttft_ms"] == pytest.approx(150.0)
    assert figures["p90_ttft_ms"] == pytest.approx(190.0)  # numpy's linear interpolation
    assert figures["mean_tpot_ms"] == pytest.approx((150.0 + 100.0) / 2)
    assert figures["mean_itl_ms"] == pytest.approx((100.0 + 200.0 + 100.0) / 3)
    assert figures["median_itl_ms"] == pytest.approx(100.0)
    assert figures["mean_e2el_ms"] == pytest.approx(350.0)
    assert figures["p99_e2el_ms"] == pytest.approx(399.0)


def test_single_token_outputs_have_no_tpot_or_itl():
    figures = summarize([_result(0.0, [0.5], tokens=1, prompt_len=4)], duration_s=1.0)
    assert figures["mean_ttft_ms"] == pytest.approx(500.0)
    assert figures["mean_tpot_ms"] is None and figures["p99_itl_ms"] is None


def test_output_throughput_is_binned_per_second():
    results = [
        _result(0.0, [0.1, 0.2, 1.5], tokens=3, prompt_len=4),
        # Usage says 4 tokens over 2 chunks: each chunk carries 2.
        _result(0.0, [2.5, 2.6], tokens=4, prompt_len=4),
    ]
    assert output_tokens_per_second(results, start_s=0.0) == [2.0, 1.0, 4.0]


def test_full_load_throughput_counts_the_window_at_full_concurrency():
    """Concurrency 2, four requests: full load lasts from the second start (1.0) to the last
    (3.0). Tokens streamed in that window count, spread over each request's chunks; the ramp
    before it and the tail after it do not."""
    results = [
        _result(0.0, [0.5, 1.5, 2.5], tokens=6, prompt_len=4),  # 2 tokens a chunk: 4 inside
        _result(1.0, [1.2, 2.0], tokens=2, prompt_len=4),  # both inside
        _result(2.5, [2.9, 3.5], tokens=2, prompt_len=4),  # one inside, one in the tail
        _result(3.0, [3.2, 4.0], tokens=2, prompt_len=4),  # all in the tail
    ]
    figures = full_load_output_throughput(results, max_concurrency=2)
    assert figures["full_load_window_s"] == pytest.approx(2.0)
    assert figures["full_load_output_throughput"] == pytest.approx((4 + 2 + 1) / 2.0)
    empty = {"full_load_output_throughput": None, "full_load_window_s": None}
    assert full_load_output_throughput(results, max_concurrency=4) == empty
    failed = RequestResult(success=False, prompt_len=4, start_s=0.2, error="HTTP 500")
    assert full_load_output_throughput([*results, failed], max_concurrency=2) == empty
    assert full_load_output_throughput(results, max_concurrency=None) == empty
    assert full_load_output_throughput(results, max_concurrency=2, request_rate=5.0) == empty


# ----------------------------------------------------------------------------- full runs


def test_run_against_a_stand_in_server_reports_every_field(tmp_path, sharegpt_pairs):
    out = tmp_path / "serve.json"
    with FakeOpenAIServer() as server:
        rc = _run_bench(
            "--base-url",
            server.base_url,
            "--dataset",
            "sharegpt",
            "--num-prompts",
            "12",
            "--max-concurrency",
            "4",
            "--seed",
            "3",
            "--server-pid",
            str(os.getpid()),
            "--output-json",
            str(out),
        )
        bodies = server.app[SERVER_LOG].bodies[1:]  # [0] is the probe request
        tokenize_calls = server.app[SERVER_LOG].tokenize_calls
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(REPORT_FIELDS) <= set(report)
    assert report["model"] == FAKE_MODEL and report["request_rate"] == "inf"
    assert (report["completed"], report["failed"], report["num_prompts"]) == (12, 0, 12)
    assert report["total_output_tokens"] == sum(body["max_tokens"] for body in bodies)
    assert report["server_cpu_seconds"] > 0 and report["server_command"] is None
    assert sum(report["output_throughput_per_s"]) == pytest.approx(report["total_output_tokens"])
    assert report["full_load_window_s"] > 0 and report["full_load_output_throughput"] > 0
    assert all(report[name] is not None for name in LATENCY_FIELDS)
    assert all(report[name] is None for name in STEP_MIX_FIELDS)  # no /metrics there
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")

    # The server's /tokenize did the counting, and it picked what a local tokenizer would have.
    assert tokenize_calls >= 24
    expected = sample_sharegpt(sharegpt_pairs, 12, seed=3, counter=_ByteCounter())
    assert sorted(body["prompt"] for body in bodies) == sorted(r.prompt for r in expected)
    for body in bodies:
        assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0
        assert body["stream_options"] == {"include_usage": True}


class _ByteCounter:
    def count_tokens(self, texts):
        return [len(text.encode("utf-8")) for text in texts]


def test_failures_are_counted_on_the_chat_endpoint_with_poisson_arrivals(
    tmp_path, byte_tokenizer_file
):
    out = tmp_path / "chat.json"
    with FakeOpenAIServer(fail_every=3) as server:
        rc = _run_bench(
            "--base-url",
            server.base_url,
            "--model",
            FAKE_MODEL,
            "--endpoint",
            "chat",
            "--dataset",
            "random",
            "--input-len",
            "20",
            "--output-len",
            "8",
            "--num-prompts",
            "9",
            "--request-rate",
            "200",
            "--tokenizer",
            str(byte_tokenizer_file),
            "--output-json",
            str(out),
        )
        tokenize_calls = server.app[SERVER_LOG].tokenize_calls
    report = json.loads(out.read_text())
    assert rc == 0 and tokenize_calls == 0
    # Server requests 2, 5, 8 fail: the probe is request 0, so benchmark requests 2, 5 and 8.
    assert (report["completed"], report["failed"]) == (6, 3)
    assert report["total_output_tokens"] == 6 * 8
    assert report["request_rate"] == 200 and report["endpoint"] == "chat"
    assert report["server_cpu_seconds"] is None  # no --server-pid: nothing to sample
    assert any("HTTP 500" in error for error in report["error_examples"])


def test_bench_needs_exactly_one_server(capsys):
    assert _run_bench("--num-prompts", "1") == 2
    assert "exactly one" in capsys.readouterr().err


# ----------------------------------------------------------------------------- launch


def _stand_in_spec(**overrides) -> launch.LaunchSpec:
    program = (sys.executable, str(Path(__file__).resolve()), "serve")
    return launch.LaunchSpec(program=program, startup_timeout_s=60, **overrides)


def test_launched_server_is_healthy_inside_the_block_and_gone_after():
    with launch.LaunchedServer(_stand_in_spec(model="tiny")) as server:
        assert launch._health_status(server.base_url) == 200
        assert server.command[-5:] == ["tiny", "--host", "127.0.0.1", "--port", str(server.port)]
        process = server._process
    assert process.poll() is not None


def test_launched_server_start_failure_shows_the_log_tail(tmp_path):
    spec = _stand_in_spec(server_args=("--crash-on-start",), log_path=str(tmp_path / "serve.log"))
    with (
        pytest.raises(launch.ServerStartError, match="planted start failure"),
        launch.LaunchedServer(spec),
    ):
        pass


@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset not installed")
def test_server_cpus_pin_the_server_with_taskset():
    import psutil

    spec = _stand_in_spec(cpus="0")
    assert launch.server_command(spec, 1234)[:3] == ["taskset", "-c", "0"]
    with launch.LaunchedServer(spec) as server:
        assert psutil.Process(server.pid).cpu_affinity() == [0]


def _ember_server_exists() -> bool:
    if importlib.util.find_spec("ember.cli") is None:
        return False
    server_package = importlib.util.find_spec("ember.server")
    return bool(list(pkgutil.iter_modules(server_package.submodule_search_locations)))


@pytest.mark.skipif(not _ember_server_exists(), reason="ember.cli / ember.server not written yet")
@pytest.mark.slow
def test_launch_runs_the_default_model_end_to_end(tmp_path):
    out = tmp_path / "launch.json"
    # Sampled ShareGPT outputs add up to ~4,000 tokens: capped so CI time stays bounded.
    command = [
        sys.executable,
        "-m",
        "ember.bench.serve",
        "--launch",
        "--disable-tqdm",
        "--dataset",
        "sharegpt",
        "--num-prompts",
        "16",
        "--max-concurrency",
        "4",
        "--sharegpt-output-len",
        "32",
        "--output-json",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(REPORT_FIELDS) <= set(report)
    assert (report["completed"], report["failed"]) == (16, 0)
    assert report["total_output_tokens"] == 16 * 32
    assert "ember.cli serve" in report["server_command"]
    assert report["server_cpu_seconds"] > 0
    # The server's step counts over the run: every prompt token fed once (no preemption at
    # this load), and every output token after a request's first came from a decode.
    assert report["scheduled_prefill_tokens"] == report["total_input_tokens"]
    assert report["scheduled_decode_tokens"] >= report["total_output_tokens"] - 16
    assert 1 <= report["steps_with_prefill"] <= 16
    assert report["steps_decode_only"] >= 31  # 32 tokens a request, 4 at a time


_EXPOSITION = """\
# TYPE ember:engine_steps_total counter
ember:engine_steps_total{kind="decode_only",model_name="m"} 90.0
ember:engine_steps_total{kind="with_prefill",model_name="m"} 30.0
ember:engine_steps_total{kind="decode_only",model_name="other"} 5.0
# TYPE ember:scheduled_tokens_total counter
ember:scheduled_tokens_total{kind="decode",model_name="m"} 2400.0
ember:scheduled_tokens_total{kind="prefill",model_name="m"} 6000.0
# TYPE engine_python_gc_collections_total counter
engine_python_gc_collections_total{generation="0"} 700.0
engine_python_gc_collections_total{generation="2"} 3.0
# TYPE engine_python_gc_pause_seconds_total counter
engine_python_gc_pause_seconds_total{generation="0"} 0.25
engine_python_gc_pause_seconds_total{generation="2"} 0.5
"""


def test_step_mix_from_two_scrapes():
    before = parse_step_counts(_EXPOSITION, "m")
    assert before == {
        "steps_decode_only": 90,
        "steps_with_prefill": 30,
        "scheduled_decode_tokens": 2400,
        "scheduled_prefill_tokens": 6000,
        "engine_gc_gen2_passes": 3,
        "engine_gc_pause_s": 0.75,  # every generation's pauses
    }
    assert parse_step_counts(_EXPOSITION, "other") is None  # not every series: no figures
    after = {
        "steps_decode_only": 150,
        "steps_with_prefill": 70,
        "scheduled_decode_tokens": 6400,
        "scheduled_prefill_tokens": 16000,
        "engine_gc_gen2_passes": 5,
        "engine_gc_pause_s": 1.0,
    }
    mix = step_mix(before, after)
    assert mix["engine_gc_gen2_passes"] == 2 and mix["engine_gc_pause_s"] == pytest.approx(0.25)
    # A server without the collector series still gets its step mix.
    no_gc = {k: v for k, v in before.items() if not k.startswith("engine_gc")}
    assert step_mix(no_gc, after)["engine_gc_pause_s"] is None
    assert step_mix(no_gc, after)["steps_with_prefill"] == 40
    assert (mix["steps_decode_only"], mix["steps_with_prefill"]) == (60, 40)
    assert mix["steps_with_prefill_fraction"] == pytest.approx(0.4)
    assert mix["mean_decodes_per_step"] == pytest.approx(4000 / 100)
    assert mix["mean_prefill_tokens_per_prefill_step"] == pytest.approx(10000 / 40)
    assert step_mix(None, after) == dict.fromkeys(STEP_MIX_FIELDS)
    report = {**dict.fromkeys(REPORT_FIELDS, 0), "model": "m", **mix}
    summary = serve.format_summary(report)
    assert "engine steps" in summary and "100 / 40" in summary
    assert "gen-2 passes / all pauses" in summary and "2 / 250.0 ms" in summary


# ----------------------------------------------------------------------------- transformers peer


def test_transformers_peer_runs_on_cpu_with_a_tiny_llama(tmp_path, byte_tokenizer_file):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ember.bench import peer_transformers

    config = LlamaConfig(
        vocab_size=258,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=256,
        eos_token_id=257,
    )
    torch.manual_seed(0)
    model_dir = tmp_path / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    shutil.copy(byte_tokenizer_file, model_dir / "tokenizer.json")
    out = tmp_path / "peer.json"
    rc = peer_transformers.main(
        [
            "--model",
            str(model_dir),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--dataset",
            "random",
            "--input-len",
            "12",
            "--output-len",
            "10",
            "--num-prompts",
            "5",
            "--max-concurrency",
            "2",
            "--block-size",
            "32",
            "--num-blocks",
            "32",
            "--max-batch-tokens",
            "256",
            "--disable-tqdm",
            "--output-json",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert (report["completed"], report["failed"], report["num_prompts"]) == (5, 0, 5)
    # Exactly the asked length each: EOS is ignored, and max_new_tokens is per request.
    assert report["total_output_tokens"] == 5 * 10
    for name in [*REPORT_FIELDS[3:], *LATENCY_FIELDS]:
        # Not the server's launch, nor ember's engine step counts (from an ember server's /metrics).
        if name not in ("server_command", "base_url", "endpoint", *STEP_MIX_FIELDS):
            assert name in report, name
    assert report["server_cpu_seconds_per_1k_output_tokens"] > 0
    assert report["gpu_util_mean"] is None


# ----------------------------------------------------------------------------- script mode


def _serve_stand_in(argv: list[str]) -> None:
    """`serve [MODEL] --host H --port N [--crash-on-start]`, as the launcher calls `ember serve`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--crash-on-start", action="store_true")
    args = parser.parse_args(argv)
    if args.crash_on_start:
        sys.exit("planted start failure")
    web.run_app(make_fake_openai_app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    _serve_stand_in(sys.argv[1:])
