"""Compiling the graphs' kernels ahead of the captures (`ember.kernels.compile_ahead`), checked on
a CPU: which launches queue a compile instead of running, and the order of the runner's
start-up passes. The real compile of a real kernel is checked on a GPU (tests/gpu)."""

from __future__ import annotations

import os

import pytest
from helpers.eager_graphs import EagerStepGraphs
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.kernels.compile_ahead import (
    MAX_COMPILE_WORKERS,
    CompileCounts,
    compile_ahead,
    compiling_ahead,
    default_compile_workers,
    launch,
)


class FakeKernel:
    """Records launches (``kernel[grid](...)``) and compile-only warm-ups apart."""

    def __init__(self) -> None:
        self.launched: list[tuple] = []
        self.warmed: list[tuple] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append((grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.warmed.append((grid, args, kwargs))


def test_launch_runs_the_kernel_outside_and_only_compiles_inside():
    kernel = FakeKernel()
    launch(kernel, (4, 2), "x", 7, BLOCK=16, num_warps=4)
    assert kernel.launched == [((4, 2), ("x", 7), {"BLOCK": 16, "num_warps": 4})]
    assert not compiling_ahead()
    with compile_ahead(2):
        assert compiling_ahead()
        launch(kernel, (8,), "y", BLOCK=32, launch_pdl=True)
    # Same arguments, grid and launch options; nothing ran.
    assert kernel.warmed == [((8,), ("y",), {"BLOCK": 32, "launch_pdl": True})]
    assert len(kernel.launched) == 1
    launch(kernel, (1,), "z")
    assert len(kernel.launched) == 2 and not compiling_ahead()


def test_an_error_in_the_block_leaves_launches_running():
    kernel = FakeKernel()
    with pytest.raises(RuntimeError, match="boom"), compile_ahead(1):
        raise RuntimeError("boom")
    launch(kernel, (1,), "x")
    assert kernel.launched and not kernel.warmed


def test_the_pass_counts_compiles_and_cache_hits_through_tritons_listener():
    """Inside the block Triton reports each compile to the counts (a warm start should show
    cache hits only); outside, whatever listener was there before is back."""
    import triton
    from triton.knobs import CompileTimes

    knobs = triton.knobs.compilation
    before = knobs.listener
    counts = CompileCounts()
    times = CompileTimes(
        ir_initialization=1_000, lowering_stages=[("ttir", 2_000)], store_results=0
    )
    with compile_ahead(1, counts):
        listener = knobs.listener
        for hit in (False, True, True):
            listener(src=None, metadata={}, metadata_group={}, times=times, cache_hit=hit)
    assert knobs.listener is before
    assert (counts.compiled, counts.from_cache) == (1, 2)
    assert counts.compile_seconds == pytest.approx(0.003)
    assert counts.cache_seconds == pytest.approx(0.006)


def test_default_workers_follow_the_cpus_this_process_may_use():
    workers = default_compile_workers()
    assert 1 <= workers <= MAX_COMPILE_WORKERS
    assert workers <= len(os.sched_getaffinity(0))


class OrderedGraphs(EagerStepGraphs):
    """Eager graphs that log each start-up pass and whether launches only compiled there."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.passes: list[tuple[str, object, bool]] = []

    def forward_for_launches(self, key) -> None:
        self.passes.append(("compile", key, compiling_ahead()))
        super().forward_for_launches(key)

    def capture(self, key) -> None:
        self.passes.append(("capture", key, compiling_ahead()))
        super().capture(key)


def test_runner_compiles_every_bucket_before_any_capture(tmp_path):
    path = make_tiny_model("LlamaForCausalLM", tmp_path / "m")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 9, 14, 3, 77, 21, 8]}
    llm = LLM(
        str(path), device="cpu", max_model_len=128, max_num_seqs=16, max_num_batched_tokens=40
    )
    plain = llm.generate([prompt], params)[0].outputs[0].token_ids
    graphs = OrderedGraphs.install(llm, max_tokens=40)
    llm.instance.runner.compile_ahead = compile_ahead  # what the Triton ops bring
    keys = graphs.all_keys
    model = llm.instance.model
    logits_rows = []  # (rows, compile pass?) of every logits projection

    def compute_logits(hidden):
        logits_rows.append((hidden.shape[0], compiling_ahead()))
        return type(model).compute_logits(model, hidden)

    model.compute_logits = compute_logits
    assert llm.instance.runner.capture_graphs(compile_workers=2) == len(keys)
    del model.compute_logits
    compile_pass, capture_pass = graphs.passes[: len(keys)], graphs.passes[len(keys) :]
    assert compile_pass == [("compile", k, True) for k in keys]
    assert capture_pass == [("capture", k, False) for k in keys]
    assert graphs.compile_seconds > 0
    # What a step runs outside its graph (a mixed step's logits, at any row count) is launched
    # in the compile pass and once more after the captures.
    for compiling in (True, False):
        assert {rows for rows, c in logits_rows if c == compiling} >= set(range(1, 17))
    # The compile pass's outputs are thrown away: tokens and KV blocks are as before.
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == plain
    assert llm.instance.kv_manager.num_free_blocks == llm.instance.kv_manager.pool.capacity


def test_no_compile_pass_without_workers(tmp_path):
    path = make_tiny_model("LlamaForCausalLM", tmp_path / "m", num_hidden_layers=1)
    llm = LLM(str(path), device="cpu", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16)
    graphs = OrderedGraphs.install(llm, max_tokens=16)
    llm.instance.runner.capture_graphs()
    assert graphs.passes and all(name == "capture" for name, _, _ in graphs.passes)
    assert graphs.compile_seconds == 0.0
    # A CPU instance compiles nothing: its kernels are not Triton's.
    assert llm.instance.load_report.compile_workers == 0


def test_a_failed_compile_pass_falls_back_to_compiling_at_first_launch(
    tmp_path, monkeypatch, caplog
):
    from contextlib import contextmanager

    @contextmanager
    def broken(workers):
        yield
        raise RuntimeError("a compile thread failed")

    path = make_tiny_model("LlamaForCausalLM", tmp_path / "m", num_hidden_layers=1)
    llm = LLM(str(path), device="cpu", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16)
    llm.instance.runner.compile_ahead = broken
    graphs = OrderedGraphs.install(llm, max_tokens=16)
    assert llm.instance.runner.capture_graphs(compile_workers=2) == len(graphs.all_keys)
    assert "compiling ahead failed" in caplog.text
    assert {key for key in graphs.captured} == set(graphs.all_keys)


def test_a_negative_worker_count_is_refused(tmp_path):
    path = make_tiny_model("LlamaForCausalLM", tmp_path / "m", num_hidden_layers=1)
    with pytest.raises(ValueError, match="compile_workers"):
        LLM(str(path), device="cpu", max_model_len=64, compile_workers=-1)


def test_each_compile_thread_builds_its_kernels_launcher_after_compiling_it():
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from ember.kernels.compile_ahead import _CompileThenBuildLauncher

    prepared = []

    def prepare(kernel):
        prepared.append((kernel, threading.current_thread().name))

    def compile_kernel(name):
        return (name, threading.current_thread().name)

    def failing_compile():
        raise RuntimeError("does not compile")

    with ThreadPoolExecutor(2, thread_name_prefix="t") as pool:
        executor = _CompileThenBuildLauncher(pool, prepare)
        kernel = executor.submit(compile_kernel, "k").result()
        with pytest.raises(RuntimeError, match="does not compile"):
            executor.submit(failing_compile).result()
    assert prepared == [(kernel, kernel[1])]  # on the thread that compiled it; not for a failure


def test_a_launcher_that_cannot_be_built_is_left_to_the_first_launch(caplog):
    from ember.kernels.compile_ahead import build_launcher

    build_launcher(object())  # no source, no metadata (and no GPU driver here): logged, no raise
    assert "launcher ahead failed" in caplog.text
