"""Split-K partial sums on the GPU: the batched cuBLAS product `LinearRouter.linear_parts` runs,
and an engine whose o and down products take it (its routes set so a tiny model's do) still
gives the reference path's greedy tokens, with CUDA graphs.

Skipped without a CUDA GPU; `tools/gpu_run.sh` runs these on the H200.
"""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.bench.parity import compare_greedy
from ember.kernels.attention_plan import AttentionTuning
from ember.kernels.linear import LinearRouter
from ember.kernels.tuning import KernelTuning, LinearRoutes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("parts", [2, 4])
def test_linear_parts_sum_to_the_product(parts):
    g = torch.Generator(device="cuda").manual_seed(parts)
    x = torch.randn(128, 1024, device="cuda", generator=g).to(torch.bfloat16)
    weight = (torch.randn(256, 1024, device="cuda", generator=g) / 32).to(torch.bfloat16)
    got = LinearRouter(LinearRoutes()).linear_parts(x, weight, parts=parts)
    assert got.shape == (parts, 128, 256) and got.dtype == torch.float32
    expected = x.float() @ weight.float().T
    torch.testing.assert_close(got.sum(0), expected, atol=1e-3, rtol=1e-3)
    slice_k = 1024 // parts
    torch.testing.assert_close(
        got[-1], x[:, -slice_k:].float() @ weight[:, -slice_k:].float().T, atol=1e-3, rtol=1e-3
    )


def test_engine_on_partial_sums_matches_the_reference_path(tmp_path, monkeypatch):
    # The tiny model's 64-wide products split in two where an 8B model's would.
    routes = LinearRoutes(split_k_max_parts=2, split_k_min_part_k=16)
    monkeypatch.setattr(
        KernelTuning,
        "for_device",
        classmethod(lambda cls, device: cls(routes, AttentionTuning.for_device(device))),
    )
    routed = []
    route = LinearRouter.split_k_parts

    def spy(self, *args):
        parts = route(self, *args)
        routed.append(parts)
        return parts

    monkeypatch.setattr(LinearRouter, "split_k_parts", spy)
    path = make_tiny_model("LlamaForCausalLM", tmp_path)
    g = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(3, 4000, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 40, (100,), generator=g)
    ]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    kwargs = {
        "device": "cuda",
        "dtype": "bfloat16",
        "max_model_len": 128,
        "kv_cache_memory_bytes": 1 << 30,
    }

    def run(backend):
        llm = LLM(str(path), backend=backend, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        llm.instance.scheduler.check_invariants()
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    reference, fast = run("reference"), run("triton")
    assert 2 in routed, "decode steps of 65-256 rows should have split o and down"
    rows = [compare_greedy(a, b) for a, b in zip(fast, reference)]
    assert all(row["near_tie"] for row in rows), rows
