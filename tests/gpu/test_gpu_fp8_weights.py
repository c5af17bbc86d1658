"""FP8 weights on the GPU: the Triton path (the skinny GEMM over FP8 tiles at decode sizes, per-
token activation quantization and ``torch._scaled_mm`` past them, CUDA graphs, overlap) against
the reference path (which dequantizes the weights and multiplies in bf16), on tiny models of each
architecture quantized at load and on FP8 checkpoints of both layouts; ``_scaled_mm`` and the
activation quantization compiled against their references; and a load that quantizes holds one
layer's float weights, not the model's. (tests/kernels/test_fp8_weight_kernels.py runs the
skinny kernel compiled against the reference too, where the GPU run takes tests/kernels.)

The paths differ where the Triton one rounds activations to FP8 (``_scaled_mm`` past the skinny
kernel's rows), which on a tiny random model moves every logprob by about a tenth of a nat. So
each model runs twice: with steps of at most 64 rows (the skinny kernel everywhere, activations
unrounded as in the reference) its greedy tokens must equal the reference's or part at a near-
tie (each in the other's top 5), as the bf16 parity tests ask; with whole prompts in one step
(``_scaled_mm``), its prompt logprobs must be nearer to the reference with its activations
rounded the same way (`helpers.fp8_emulation`) than that rounding moves them. Skipped without a
CUDA GPU; `tools/gpu_run.sh` runs these on the GPU.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers.fp8_checkpoints import fp8_checkpoint
from helpers.fp8_emulation import rounded_activations
from helpers.gpu_parity import DENSE_ARCHS, mean_prompt_logprob_gap, random_prompts
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.bench.parity import compare_greedy
from ember.kernels.fp8_gemm import fp8_linear, quantize_rows_fp8, takes_scaled_mm
from ember.kernels.tuning import LinearRoutes
from ember.layers.fp8 import Fp8Weight, dense_weight, quantize_rows
from ember.layers.ops import reference_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ARCHS = DENSE_ARCHS
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
PROMPT_PARAMS = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
# Steps of at most this many rows take the skinny FP8 kernel (bf16 activations) throughout.
SKINNY_STEP_ROWS = LinearRoutes().fp8_skinny_max_rows


@pytest.fixture(scope="module", params=ARCHS)
def tiny_dir(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def _run(path, backend: str, prompts, params=PARAMS, monkeypatch=None, **options):
    """Greedy tokens and logprobs, and the outputs. ``monkeypatch`` given, the reference path
    folds its norms as the Triton path does, so both quantize the same weights."""
    if monkeypatch is not None and backend == "reference":
        instance_module = importlib.import_module("ember.engine.model_instance")
        monkeypatch.setattr(instance_module, "select_ops", lambda *a, **k: reference_ops(True))
    llm = LLM(
        str(path),
        backend=backend,
        device="cuda",
        dtype="bfloat16",
        max_model_len=256,
        kv_cache_memory_bytes=1 << 30,
        **options,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.instance.scheduler.check_invariants()
    if backend == "triton":
        assert llm.instance.runner.graphs.captured, "steps should have used CUDA graphs"
    if monkeypatch is not None and backend == "reference":
        monkeypatch.undo()
    return outs


def _tokens(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _assert_near_ties(fast, reference) -> None:
    rows = [compare_greedy(a, b) for a, b in zip(_tokens(fast), _tokens(reference), strict=True)]
    assert all(row["near_tie"] for row in rows), rows


def _assert_skinny_parity(path, prompts, monkeypatch=None, **options):
    """Steps of at most `SKINNY_STEP_ROWS` rows: greedy tokens equal or part at near-ties."""
    options = {"max_num_batched_tokens": SKINNY_STEP_ROWS, **options}
    reference = _run(path, "reference", prompts, monkeypatch=monkeypatch, **options)
    _assert_near_ties(_run(path, "triton", prompts, **options), reference)


def _assert_rounded_activation_parity(path, prompts, monkeypatch, **options):
    """Whole prompts in one step: the Triton path's prompt logprobs are nearer to the reference
    with FP8-rounded activations than the rounding moves the reference's."""
    plain = _run(path, "reference", prompts, PROMPT_PARAMS, **options)
    with rounded_activations(monkeypatch):
        rounded = _run(path, "reference", prompts, PROMPT_PARAMS, **options)
    fast = _run(path, "triton", prompts, PROMPT_PARAMS, **options)
    rounding = mean_prompt_logprob_gap(rounded, plain)
    assert rounding > 0, "the emulation should have rounded the reference's activations"
    gap = mean_prompt_logprob_gap(fast, rounded)
    assert gap < rounding, (gap, rounding)


@pytest.mark.parametrize("fold", [False, True], ids=["plain-norms", "folded-norms"])
def test_triton_path_matches_reference_quantized_at_load(tiny_dir, fold, monkeypatch):
    """16 prompts of up to 90 tokens, in steps of at most 64 rows (the skinny kernel). ``fold``:
    norms folded into the weights before they are quantized (the Triton path's default) on both
    paths; else on neither."""
    prompts = random_prompts(16)
    if fold:
        _assert_skinny_parity(tiny_dir, prompts, monkeypatch, quantization="fp8")
    else:
        _assert_skinny_parity(tiny_dir, prompts, quantization="fp8", defer_norms=False)


def test_fp8_weights_widened_in_ptx_give_the_tokens_of_the_conversions(tiny_dir):
    """The default (FP8 widened in PTX) against `--no-fp8-widen-in-registers`: the skinny
    kernel's FP8 tiles widen to the same bf16 values by their bits as by Triton's conversions,
    so tokens and logprobs are the same."""
    prompts = random_prompts(8)
    options = {"max_num_batched_tokens": SKINNY_STEP_ROWS, "quantization": "fp8"}
    converted = _tokens(_run(tiny_dir, "triton", prompts, fp8_widen_in_registers=False, **options))
    in_ptx = _tokens(_run(tiny_dir, "triton", prompts, fp8_widen_in_registers=True, **options))
    assert in_ptx == converted


def test_scaled_mm_path_matches_reference_with_rounded_activations(tiny_dir, monkeypatch):
    """The same prompts, each step whole (``_scaled_mm`` for every product of the prefill)."""
    _assert_rounded_activation_parity(
        tiny_dir, random_prompts(16), monkeypatch, quantization="fp8", defer_norms=False
    )


@pytest.mark.parametrize("layout", ["compressed-tensors", "fp8"])
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_triton_path_matches_reference_on_an_fp8_checkpoint(tmp_path, arch, layout):
    """Per-channel and per-tensor scales (Qwen2: with the q/k/v bias): greedy parity on a bf16
    cache. The per-tensor checkpoint's KV-cache scales applied to an FP8 cache on both paths:
    there the paths' last-bit differences (the FP8 weights' products) cross e4m3 rounding
    boundaries (6% steps) and compound over a random tiny model's flat distributions, so
    greedy tokens part at more than near-ties; what must hold is that the paths' prompt
    logprobs differ by less than the FP8 cache itself moves the reference's."""
    source = make_tiny_model(arch, tmp_path / "source")
    kv_scales = (0.37, 1.9) if layout == "fp8" else None
    path = fp8_checkpoint(source, tmp_path / layout, layout, kv_scales=kv_scales)
    prompts = random_prompts(16, seed=1)
    _assert_skinny_parity(path, prompts)
    if kv_scales is None:
        return
    options = {"max_num_batched_tokens": SKINNY_STEP_ROWS}
    bf16_cache = _run(path, "reference", prompts, PROMPT_PARAMS, **options)
    options["kv_cache_dtype"] = "fp8"
    reference = _run(path, "reference", prompts, PROMPT_PARAMS, **options)
    fast = _run(path, "triton", prompts, PROMPT_PARAMS, **options)
    cache_effect = mean_prompt_logprob_gap(reference, bf16_cache)
    gap = mean_prompt_logprob_gap(fast, reference)
    assert gap < cache_effect, (gap, cache_effect)


def test_scaled_mm_multiplies_the_fp8_operands_exactly_as_dequantized():
    """``fp8_linear`` past decode sizes: activations quantized per row, then cuBLASLt's FP8 GEMM
    with both scales. Against the same FP8 values dequantized and multiplied in float32, it
    differs by its bf16 output rounding and accumulation only; against the bf16
    activations (the reference path), by the activations' FP8 rounding too."""
    gen = torch.Generator().manual_seed(0)
    k, n = 4096, 6144
    weight, scale = quantize_rows(torch.randn(n, k, generator=gen) / k**0.5)
    fp8 = Fp8Weight(weight.cuda(), scale[:, 0].contiguous().cuda())
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).cuda()
    dense = dense_weight(fp8, torch.float32)
    for m in (65, 300, 2048):
        x = torch.randn(m, k + 64, generator=gen).to(torch.bfloat16).cuda()[:, :k]  # strided
        assert takes_scaled_mm(x, fp8)
        out = fp8_linear(x, fp8, bias)
        q, row_scale = quantize_rows(x)
        exact = (q.float() * row_scale) @ dense.t() + bias.float()
        # Hopper's FP8 tensor cores accumulate in less than float32 between cuBLAS's
        # promotions: a rare element is off by a few bf16 ulps, the whole product by ~1e-3.
        error = (out.float() - exact).norm() / exact.norm()
        assert error < 4e-3, error
        assert (out.float() - exact).abs().max() < 0.15
        reference = x.float() @ dense.t() + bias.float()
        relative = (out.float() - reference).norm() / reference.norm()
        assert relative < 0.05  # e4m3 rounds each activation by up to 2**-4


def test_scaled_mm_runs_inside_a_cuda_graph():
    """No host sync: captured once, a replay on new activations gives the eager product."""
    gen = torch.Generator().manual_seed(1)
    weight, scale = quantize_rows(torch.randn(512, 256, generator=gen))
    fp8 = Fp8Weight(weight.cuda(), scale[:, 0].contiguous().cuda())
    x = torch.randn(128, 256, generator=gen).to(torch.bfloat16).cuda()
    fp8_linear(x, fp8)  # compile the quantization kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, fp8)
    x.copy_(torch.randn(128, 256, generator=gen).to(torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(out, fp8_linear(x, fp8), atol=0, rtol=0)


def test_compiled_activation_quantization_is_bit_exact():
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(64, 14336, generator=gen) * 3).to(torch.bfloat16)
    x[5] = 0
    q, scale = quantize_rows_fp8(x.cuda())
    expected_q, expected_scale = quantize_rows(x)
    assert torch.equal(scale.cpu(), expected_scale)
    assert torch.equal(q.cpu().view(torch.uint8), expected_q.view(torch.uint8))


def test_quantizing_at_load_holds_one_layers_float_weights(tmp_path):
    """The float weights land a layer at a time into scratch that is quantized and dropped: the
    load's peak of allocated memory beyond a bf16 load of the same model stays under four of
    its twelve layers' bf16 weights (one layer's scratch, and the float32 blocks of rows the
    quantization works in)."""
    path = make_tiny_model(
        "LlamaForCausalLM",
        tmp_path / "m",
        num_hidden_layers=12,
        hidden_size=512,
        intermediate_size=2048,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
    )
    layer_bytes = 2 * (512 * (512 + 2 * 128) + 512 * 512 + 3 * 512 * 2048)
    peaks = {}
    for quantization in (None, "fp8"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        llm = LLM(
            str(path),
            device="cuda",
            dtype="bfloat16",
            max_model_len=256,
            kv_cache_memory_bytes=64 << 20,
            enforce_eager=True,
            quantization=quantization,
        )
        peaks[quantization] = torch.cuda.max_memory_allocated() - before
        del llm
    assert peaks["fp8"] - peaks[None] < 4 * layer_bytes
