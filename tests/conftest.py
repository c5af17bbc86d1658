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


@pytest.fixture
def tiny_bench_factory(tmp_path):
    """``make(ceilings, sustained=None, nvml_handle=None, device="cpu")``: a StepBench over one
    tiny-preset checkpoint, with the ceilings given."""
    from ember.bench.make_model import make_model
    from ember.bench.step_bench import StepBench
    from ember.config import CacheConfig, EngineConfig, SchedulerConfig
    from ember.engine.model_instance import ModelInstance

    # The GPU machine has SmolLM2's saved tokenizer files, not the GGUF make_model builds from.
    saved = os.environ.get("EMBER_TEST_TOKENIZER_DIR")
    path = make_model(
        "tiny", tmp_path / "tiny", device="cpu", tokenizer_dir=Path(saved) if saved else None
    )

    def make(ceilings, sustained=None, nvml_handle=None, device="cpu"):
        config = EngineConfig(
            model=str(path),
            device=device,
            cache=CacheConfig(num_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256),
        )
        return StepBench(ModelInstance(config), ceilings, sustained, nvml_handle)

    return make
