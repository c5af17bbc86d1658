"""The whole engine on the Triton kernels (interpreted on a CPU) gives the reference's tokens."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers.eager_graphs import EagerStepGraphs
from helpers.fp8_checkpoints import fp8_checkpoint
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture
def qk_norm_spy(monkeypatch):
    """Where the Triton path's q/k norms run: the widths of the RMSNorm kernel's rows (set up
    before an instance's ops are made), and the kernels the ``qk_norm`` option reached."""
    from ember.kernels import attention_step, rmsnorm

    seen = {"norm_widths": set(), "fused_into": set()}
    rms_norm, rope_and_cache_write = rmsnorm.rms_norm, attention_step.rope_and_cache_write
    paged_attention = attention_step.paged_attention

    def norm_spy(x, *args, **kwargs):
        seen["norm_widths"].add(x.shape[-1])
        return rms_norm(x, *args, **kwargs)

    def rope_spy(*args, **kwargs):
        if kwargs.get("qk_norm") is not None:
            seen["fused_into"].add("rope_and_cache_write")
        return rope_and_cache_write(*args, **kwargs)

    def attention_spy(*args, **kwargs):
        if kwargs.get("rope") is not None and kwargs["rope"].qk_norm is not None:
            seen["fused_into"].add("paged_attention")
        return paged_attention(*args, **kwargs)

    monkeypatch.setattr(rmsnorm, "rms_norm", norm_spy)
    monkeypatch.setattr(attention_step, "rope_and_cache_write", rope_spy)
    monkeypatch.setattr(attention_step, "paged_attention", attention_spy)
    return seen


def assert_qk_norms_fused(llm, seen):
    """A Qwen3 model's q/k norms ran inside the RoPE kernel (prefill chunks) and the attention
    kernel (decodes), never as RMSNorm launches over head-wide rows; other models pass none."""
    cfg = llm.instance.model.cfg
    assert cfg.head_dim not in seen["norm_widths"]
    assert seen["fused_into"] == (
        {"rope_and_cache_write", "paged_attention"} if cfg.qk_norm else set()
    )


@pytest.mark.parametrize(
    "arch",
    [
        "LlamaForCausalLM",
        "Qwen3ForCausalLM",
        "MixtralForCausalLM",
        "GptOssForCausalLM",
        "Llama4ForCausalLM",
    ],
)
def test_triton_backend_matches_reference_backend(arch, tmp_path, device, gen, qk_norm_spy):
    path = make_tiny_model(arch, tmp_path)
    prompts = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (3, 17, 40)]
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=3, max_tokens=6),
        SamplingParams(temperature=1.0, min_p=0.05, seed=4, max_tokens=6),
    ]
    outputs = {}
    for backend in ("reference", "triton"):
        # A small token budget chunks the longer prompts, so chunks start mid-sequence.
        llm = LLM(
            str(path),
            device=str(device),
            max_model_len=128,
            backend=backend,
            dtype="float32",  # bf16 rounding differs between the paths: tokens may flip on a GPU
            max_num_batched_tokens=16,
            kv_cache_memory_bytes=64 << 20,
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        outputs[backend] = [o.outputs[0].token_ids for o in outs]
        llm.instance.scheduler.check_invariants()
    assert outputs["triton"] == outputs["reference"]
    assert_qk_norms_fused(llm, qk_norm_spy)


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "MixtralForCausalLM", "Llama4ForCausalLM"])
def test_fp8_experts_on_the_kernels_give_the_reference_tokens(
    arch, tmp_path, device, gen, qk_norm_spy
):
    """An FP8 checkpoint's experts through the fused MoE kernels (decode steps by pair, prompt
    chunks grouped) against the reference's dequantizing loop, in float32: the same tokens.
    Llama 4's experts take their router-scaled inputs, beside its FP8 shared expert and dense
    MLPs, and its q/k rows reordered with their scales."""
    path = fp8_checkpoint(make_tiny_model(arch, tmp_path / "float"), tmp_path / "fp8", "fp8")
    prompts = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (1, 12, 30)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = {}
    for backend in ("reference", "triton"):
        llm = LLM(
            str(path),
            device=str(device),
            max_model_len=64,
            backend=backend,
            dtype="float32",
            max_num_batched_tokens=32,
            kv_cache_memory_bytes=16 << 20,
        )
        assert llm.instance.model.layers[1].mlp.fp8_weights()  # every family's: experts
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        outputs[backend] = [o.outputs[0].token_ids for o in outs]
    assert outputs["triton"] == outputs["reference"]
    assert_qk_norms_fused(llm, qk_norm_spy)


def test_parity_bench_runs_and_agrees(tmp_path, device):
    from ember.bench.make_model import make_model
    from ember.bench.parity import run_parity

    # Saved tokenizer files where the GPU machine has no GGUF (EMBER_TEST_TOKENIZER_DIR).
    saved = os.environ.get("EMBER_TEST_TOKENIZER_DIR")
    path = make_model("tiny", tmp_path / "tiny", device="cpu", tokenizer_dir=saved and Path(saved))
    result = run_parity(
        str(path),
        num_prompts=2,
        max_tokens=3,
        dtype="float32",
        max_prompt_len=20,
        kv_bytes=16 << 20,
    )
    assert result["identical_sequences"] == 2
    assert all(row["first_difference_at"] is None for row in result["rows"])


def test_padded_graph_inputs_on_the_kernels_give_the_reference_tokens(tmp_path, device):
    """The graph paths' padding (empty sequences, tokens of no sequence, slot -1) through the
    Triton kernels, with replay run eagerly: the tokens of the unpadded reference run."""
    path = make_tiny_model("LlamaForCausalLM", tmp_path)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (3, 9, 21, 30)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outputs = {}
    for backend in ("reference", "triton"):
        llm = LLM(
            str(path),
            device=str(device),
            max_model_len=64,
            backend=backend,
            max_num_seqs=8,
            dtype="float32",
            max_num_batched_tokens=24,
            kv_cache_memory_bytes=16 << 20,
            lazy_cuda_graphs=True,
        )
        graphs = EagerStepGraphs.install(llm, max_tokens=24) if backend == "triton" else None
        if graphs is not None:  # start-up capture's padded empty steps, through the kernels
            assert llm.instance.runner.capture_graphs() == len(graphs.all_keys)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        outputs[backend] = [o.outputs[0].token_ids for o in outs]
    assert outputs["triton"] == outputs["reference"]
    kinds = {key.decode for key, _ in graphs.replayed}
    assert kinds == {True, False}
