"""A model quantized to FP8 at load on the Triton path, interpreted on a CPU, against the
reference path: every product of up to 64 rows through the skinny GEMM over FP8 tiles (with its
residual-add and SiLU epilogues under deferred norms), larger ones through the per-token
activation quantization and ``torch._scaled_mm`` (routing forced for the CPU, where torch has
the op). Both paths fold the norms before quantizing, so they hold the same FP8 weights; where
their greedy tokens part (the FP8 GEMM also rounds activations), the two are a near-tie.
tests/gpu/test_gpu_fp8_weights.py runs the same on the GPU."""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers.scaled_mm import cpu_has_scaled_mm
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.bench.parity import compare_greedy
from ember.kernels import fp8_gemm
from ember.kernels.linear import LinearRouter
from ember.layers.ops import reference_ops

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cpu_has_scaled_mm(), reason="this torch has no CPU _scaled_mm"),
]


def _run(path, device, backend: str, prompts):
    llm = LLM(
        str(path),
        device=str(device),
        backend=backend,
        dtype="bfloat16",
        quantization="fp8",
        max_model_len=128,
        max_num_batched_tokens=80,
        kv_cache_memory_bytes=16 << 20,
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.instance.model.defers_norms
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_fp8_weights_on_the_kernels_give_the_reference_tokens(tmp_path, device, monkeypatch):
    routed = {"skinny": [], "scaled_mm": []}

    def skinny_rows(router, m, dtype, device):
        routed["skinny"].append(m)
        return 0 < m <= router.routes.skinny_max_rows

    def aligned_bf16(x, weight):
        routed["scaled_mm"].append(x.shape[0])
        n, k = weight.weight.shape
        return x.dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0

    path = make_tiny_model("LlamaForCausalLM", tmp_path)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (3, 70)]
    instance_module = importlib.import_module("ember.engine.model_instance")
    with monkeypatch.context() as patch:
        patch.setattr(instance_module, "select_ops", lambda *a, **k: reference_ops(True))
        expected = _run(path, device, "reference", prompts)
    monkeypatch.setattr(LinearRouter, "takes_fp8_skinny", skinny_rows)
    monkeypatch.setattr(fp8_gemm, "takes_scaled_mm", aligned_bf16)
    got = _run(path, device, "triton", prompts)
    assert any(m <= 64 for m in routed["skinny"]) and any(m > 64 for m in routed["scaled_mm"])
    rows = [compare_greedy(a, b) for a, b in zip(got, expected, strict=True)]
    assert all(row["near_tie"] for row in rows), rows
