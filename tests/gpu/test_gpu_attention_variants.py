"""Windows, chunks, sinks, NoPE and QK L2 norm on the compiled kernels at bf16, against the
reference: long decodes (a 128-key window of a 4,000-token context, as gpt-oss's sliding
layers; split-KV by the H200 table's heuristic or forced), mixed steps of long chunks, and a
sliding-window Mistral through the engine with CUDA graphs. (tests/kernels/
test_attention_variants.py runs the same kernels compiled where the GPU run takes
tests/kernels.)

Skipped without a CUDA GPU; `tools/gpu_run.sh` runs these on the H200.
"""

from __future__ import annotations

import pytest
import torch
from helpers.attention_steps import copy_step, random_step, split_qkv, step_context
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.bench.parity import compare_greedy
from ember.config import StepLimits
from ember.layers.attention import ReferenceAttention, select_attention
from ember.layers.ops import triton_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HEADS, KV_HEADS, HEAD_DIM, PAGE = 64, 8, 64, 16  # gpt-oss-20b's attention shape


def _run(backend, step, device, **options):
    s = copy_step(step, device)
    q, k, v = split_qkv(s["qkv"], HEADS, KV_HEADS, HEAD_DIM)
    out = torch.full_like(q, float("nan"))
    options = {k: v.to(device) if torch.is_tensor(v) else v for k, v in options.items()}
    ctx = step_context(s)
    backend.forward(
        q, k, v, ctx, s["cos_sin"], s["k_cache"], s["v_cache"], HEAD_DIM**-0.5, out, **options
    )
    return out.float().cpu()


def _step(gen, q_lens, seq_lens):
    step = random_step(gen, q_lens, seq_lens, HEADS, KV_HEADS, HEAD_DIM, PAGE)
    step["cos_sin"] = torch.cat([step["cos_sin"]] * 8)  # positions past 1,024
    return {
        k: v.to(torch.bfloat16) if k in ("qkv", "k_cache", "v_cache") else v
        for k, v in step.items()
    }


OPTIONS = [
    {"window": 128, "sinks": True},
    {"chunk_size": 1024, "use_rope": False},
    {"chunk_size": 512, "qk_l2_norm_eps": 1e-5},
    {"sinks": True},
]
STEPS = {
    "decode-long": ([1] * 4, [4000, 130, 128, 2500]),
    "decode-batch": ([1] * 48, [200 + 83 * i for i in range(48)]),
    "mixed": ([300, 1, 1, 77], [2300, 4000, 90, 1100]),
}


@pytest.mark.parametrize("fuse_decode", [True, False])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(o))
@pytest.mark.parametrize("shape", list(STEPS))
def test_kernels_match_reference_at_bf16(shape, options, fuse_decode):
    gen = torch.Generator().manual_seed(0)
    step = _step(gen, *STEPS[shape])
    if options.get("sinks"):
        options = dict(options, sinks=(torch.randn(HEADS, generator=gen) * 2).to(torch.bfloat16))
    triton = select_attention(
        triton_ops(),
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        torch.bfloat16,
        torch.device("cuda"),
        StepLimits(max_num_seqs=64),
        fuse_decode=fuse_decode,
    )
    expected = _run(ReferenceAttention(), step, "cpu", **options)
    got = _run(triton, step, "cuda", **options)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def test_a_sliding_window_mistral_through_cuda_graphs_matches_the_reference():
    """A window (32 keys) far shorter than the prompts and generations, bf16, the Triton path
    with CUDA graphs against the reference path: the same greedy tokens but for near-ties."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model("MistralForCausalLM", tmp, sliding_window=32)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (5, 40, 150, 300)]
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=5)
        results = {}
        for backend in ("reference", "triton"):
            llm = LLM(
                str(path),
                backend=backend,
                device="cuda",
                dtype="bfloat16",
                max_model_len=512,
                kv_cache_memory_bytes=1 << 30,
                lazy_cuda_graphs=True,
            )
            assert llm.instance.model.layers[0].self_attn.window == 32
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            results[backend] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
            if backend == "triton":
                assert llm.instance.runner.graphs.captured
    rows = [compare_greedy(a, b) for a, b in zip(results["triton"], results["reference"])]
    assert all(row["near_tie"] for row in rows), rows
