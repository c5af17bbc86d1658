"""The FP8 KV cache on the GPU: the Triton path (compiled kernels, CUDA graphs, overlap) against
the reference path, both on a float8 e4m3 cache with scales other than 1 in every layer, on
tiny models of each architecture. (tests/kernels/test_fp8_kv_kernels.py runs the kernels compiled
against the reference too, where the GPU run takes tests/kernels.)

Skipped without a CUDA GPU; `tools/gpu_run.sh` runs these on the H200.
"""

from __future__ import annotations

import pytest
import torch
from helpers.gpu_parity import DENSE_ARCHS, random_prompts
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.bench.parity import compare_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ARCHS = DENSE_ARCHS
KV_SCALES = (0.37, 1.9)


@pytest.fixture(scope="module", params=ARCHS)
def tiny_dir(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def _run(path, backend: str, dtype: str, prompts, params, **options):
    """Greedy tokens and logprobs on an FP8 cache whose layers carry ``KV_SCALES``, set before
    the first step: CUDA graphs bake the scales in when they capture (lazily, at first use)."""
    llm = LLM(
        str(path),
        backend=backend,
        device="cuda",
        dtype=dtype,
        kv_cache_dtype="fp8",
        max_model_len=256,
        kv_cache_memory_bytes=1 << 30,
        lazy_cuda_graphs=True,
        **options,
    )
    assert llm.instance.kv_cache.dtype == torch.float8_e4m3fn
    for layer in llm.instance.model.layers:
        layer.self_attn.k_scale, layer.self_attn.v_scale = KV_SCALES
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.instance.scheduler.check_invariants()
    if backend == "triton":
        assert llm.instance.runner.graphs.captured, "steps should have used CUDA graphs"
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_fp8_path_matches_reference_fp8_path(tiny_dir, dtype):
    """Both paths store the same float8 values but for a rare one a step apart (the compiled
    rotation may fuse multiply-adds; the products differ in their last bits), and one e4m3 step
    is 6%: where the greedy tokens part, the two tokens must be a near-tie (each in the other's
    top 5), as the bf16 parity test asks."""
    prompts = random_prompts(16)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    reference = _run(tiny_dir, "reference", dtype, prompts, params)
    fast = _run(tiny_dir, "triton", dtype, prompts, params)
    rows = [compare_greedy(a, b) for a, b in zip(fast, reference)]
    assert all(row["near_tie"] for row in rows), rows


def test_fp8_tiles_widened_in_ptx_give_the_tokens_of_the_conversions(tiny_dir):
    """The default (FP8 widened in PTX) against `--no-fp8-widen-in-registers`: the cache's
    tiles widen to the same bf16 values by their bits as by Triton's conversions, so the greedy
    tokens and logprobs are the same."""
    prompts = random_prompts(8)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    converted = _run(tiny_dir, "triton", "bfloat16", prompts, params, fp8_widen_in_registers=False)
    in_ptx = _run(tiny_dir, "triton", "bfloat16", prompts, params, fp8_widen_in_registers=True)
    assert in_ptx == converted
