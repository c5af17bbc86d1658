"""Shared pytest setup: make `tests/helpers` importable as `helpers`."""

import os
import sys
from pathlib import Path

import pytest

_TESTS_DIR = str(Path(__file__).parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

# Before anything imports ember.kernels: interpret Triton on a CPU (see the helper).
from helpers import triton_interpreter

triton_interpreter.configure()


def pytest_collection_modifyitems(items):
    """``pytest -m fast``: every CPU test not marked slow, a check of a change in under a
    minute (the whole suite is the README's test command)."""
    for item in items:
        if item.get_closest_marker("slow") is None and item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.fast)


@pytest.fixture
def tiny_bench_factory(tmp_path):
    """``make(ceilings, sustained=None, nvml_handle=None, device="cpu", **options)``: a
    StepBench over one tiny-preset checkpoint, with the ceilings given; ``options``: further
    `engine_config` options."""
    from ember.bench.make_model import make_model
    from ember.bench.step_bench import StepBench
    from ember.config import engine_config
    from ember.engine.model_instance import ModelInstance

    # The GPU machine has SmolLM2's saved tokenizer files, not the GGUF make_model builds from.
    saved = os.environ.get("EMBER_TEST_TOKENIZER_DIR")
    path = make_model(
        "tiny", tmp_path / "tiny", device="cpu", tokenizer_dir=Path(saved) if saved else None
    )

    def make(ceilings, sustained=None, nvml_handle=None, device="cpu", **options):
        config = engine_config(
            str(path),
            device=device,
            num_gpu_blocks_override=64,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            max_model_len=256,
            **options,
        )
        return StepBench(ModelInstance(config), ceilings, sustained, nvml_handle)

    return make
