"""Deferred RMSNorm (ember.layers.row_norm): the kernels that leave a row's sums of squares
(`skinny_gemm_add`, `add_and_sum_squares`) and those that apply its 1/rms (SiLU-and-mul; RoPE and
the cache write, in their own kernel or in attention's: tests/kernels/test_attention_step.py)
against the reference, and the engine on the deferred form against the plain one."""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.kernels.activation import silu_and_mul
from ember.kernels.rmsnorm import add_and_sum_squares
from ember.kernels.skinny_gemm import skinny_gemm_add, skinny_gemm_silu
from ember.layers.ops import reference_ops
from ember.layers.reference_ops import (
    add_and_sum_squares_reference,
    gate_up_silu_reference,
    linear_add_reference,
    rms_norm_reference,
    silu_and_mul_reference,
)
from ember.layers.row_norm import RowNorm


def random_row_norm(gen, rows: int, num_parts: int, hidden: int) -> RowNorm:
    """Statistics of rows of mean square ~1, split unevenly over ``num_parts`` columns."""
    parts = torch.rand(rows, num_parts, generator=gen) * (2 * hidden / num_parts)
    return RowNorm(parts, hidden, 1e-5)


def test_row_norm_applies_the_rms_norm_of_the_rows(gen):
    x = torch.randn(5, 64, generator=gen)
    row_norm = RowNorm(add_and_sum_squares_reference(x.clone()), 64, 1e-6)
    normed = rms_norm_reference(x, torch.ones(64), 1e-6)
    torch.testing.assert_close(row_norm.apply(x), normed, atol=1e-6, rtol=1e-5)


def test_row_norm_rejects_bad_parts():
    with pytest.raises(ValueError, match="float32"):
        RowNorm(torch.zeros(3, 2, dtype=torch.float16), 8, 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        RowNorm(torch.zeros(2, 3).t(), 8, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_parts", [1, 37, 300])  # one column (cuBLAS path), ragged, over 256
def test_silu_and_mul_applies_the_row_norm(gen, device, dtype, num_parts):
    inter, rows = 1100, 6
    x = (torch.randn(rows, 2 * inter, generator=gen) * 3).to(dtype)
    row_norm = random_row_norm(gen, rows + 2, num_parts, 4096)  # more rows than x: allowed
    on_device = RowNorm(row_norm.parts.to(device), row_norm.hidden_size, row_norm.eps)
    out = silu_and_mul(x.to(device), row_norm=on_device)
    expected = silu_and_mul_reference(
        x, row_norm=RowNorm(row_norm.parts[:rows].contiguous(), 4096, 1e-5)
    )
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "num_parts"), [(1, 1), (5, 37), (20, 300)])
def test_gated_skinny_gemm_applies_the_row_norm(gen, device, dtype, rows, num_parts):
    """SiLU-and-mul in the gate/up GEMM's epilogue scales gate and up by 1/rms as the SiLU
    kernel would (padding rows of the tile: 16 and 32 rows for 1 and 20)."""
    inter, k = 80, 256
    x = torch.randn(rows, k, generator=gen).to(dtype)
    weight = (torch.randn(2 * inter, k, generator=gen) * 3 / k**0.5).to(dtype)
    row_norm = random_row_norm(gen, rows, num_parts, 4096)
    on_device = RowNorm(row_norm.parts.to(device), row_norm.hidden_size, row_norm.eps)
    config = {
        "BLOCK_M": 16 if rows <= 16 else 32,
        "BLOCK_N": 32,
        "BLOCK_K": 64,
        "STAGES": 2,
        "num_warps": 4,
    }
    out = skinny_gemm_silu(x.to(device), weight.to(device), row_norm=on_device, config=config)
    expected = gate_up_silu_reference(x.double(), weight.double(), row_norm=row_norm)
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # bf16: the product and scaling each rounded
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)


def test_silu_and_mul_rejects_too_few_statistics(device):
    x = torch.zeros(4, 64, device=device)
    with pytest.raises(ValueError, match="row_norm covers 3 rows"):
        silu_and_mul(x, row_norm=RowNorm(torch.ones(3, 1, device=device), 64, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_x", [True, False])
def test_add_and_sum_squares_matches_reference(gen, device, dtype, with_x):
    residual = torch.randn(7, 300, generator=gen).to(dtype)
    x = torch.randn(7, 300, generator=gen).to(dtype) if with_x else None
    got_residual = residual.clone().to(device)
    sums = add_and_sum_squares(got_residual, None if x is None else x.to(device))
    expected = add_and_sum_squares_reference(residual, x)
    assert sums.dtype == torch.float32 and sums.shape == (7, 1)
    assert torch.equal(got_residual.cpu(), residual)  # the add rounds once, to the dtype
    torch.testing.assert_close(sums.cpu(), expected, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 96, 512), (3, 100, 300), (33, 70, 200)])
def test_skinny_gemm_add_updates_the_stream_and_sums_its_squares(gen, device, dtype, m, n, k):
    x = torch.randn(m, k, generator=gen).to(dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    residual = torch.randn(m, n, generator=gen).to(dtype)
    got_residual = residual.clone().to(device)
    parts = skinny_gemm_add(x.to(device), weight.to(device), got_residual)
    expected_residual = residual.clone()
    expected_sums = linear_add_reference(x, weight, expected_residual)
    assert parts.dtype == torch.float32 and parts.shape[0] == m and parts.shape[1] > 1
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        got_residual.cpu().float(), expected_residual.float(), atol=tol, rtol=tol
    )
    # The statistics are those of the stored (rounded) rows, whatever the product's last bits.
    own_sums = got_residual.cpu().float().pow(2).sum(-1)
    torch.testing.assert_close(parts.cpu().sum(-1), own_sums, atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(parts.cpu().sum(-1), expected_sums[:, 0], atol=tol * k, rtol=tol)


def test_skinny_gemm_add_rejects_a_misshapen_stream(device):
    x, w = torch.zeros(2, 64, device=device), torch.zeros(32, 64, device=device)
    with pytest.raises(ValueError, match="residual must be"):
        skinny_gemm_add(x, w, torch.zeros(2, 16, device=device))


def _greedy_tokens(path, device, backend, dtype="float32"):
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (4, 19, 33)]
    llm = LLM(
        str(path),
        device=str(device),
        max_model_len=64,
        backend=backend,
        dtype=dtype,
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=16 << 20,
    )
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM"])
def test_the_deferred_reference_gives_the_plain_tokens_and_folds_only_where_it_can(
    tmp_path, monkeypatch, arch
):
    """The deferred form's data flow in plain PyTorch (fast, no interpreter): same tokens; a
    model with a q/k norm between projection and attention, or with a mixture of experts,
    keeps the plain form."""
    path = make_tiny_model(arch, tmp_path)
    plain, _ = _greedy_tokens(path, "cpu", "reference")
    instance_module = importlib.import_module("ember.engine.model_instance")
    monkeypatch.setattr(instance_module, "select_ops", lambda *a, **k: reference_ops(True))
    deferred, llm = _greedy_tokens(path, "cpu", "reference")
    model = llm.instance.model
    assert model.defers_norms == (arch == "LlamaForCausalLM")
    layer = model.layers[0]
    assert torch.equal(layer.input_layernorm, torch.ones_like(layer.input_layernorm)) == (
        model.defers_norms
    )
    assert deferred == plain


@pytest.mark.slow
def test_the_skinny_epilogue_path_gives_the_reference_tokens(tmp_path, device, monkeypatch):
    """Every product of <= 64 rows through the skinny kernel (routing forced for the CPU), so o
    and down add into the stream in its epilogue: the reference backend's tokens."""
    from ember.kernels.linear import LinearRouter

    routed = []

    def small_products(router, m, n, k, dtype, device, pdl=False):
        routed.append(m)
        return 0 < m <= router.routes.skinny_max_rows

    monkeypatch.setattr(LinearRouter, "takes_skinny", small_products)
    path = make_tiny_model("LlamaForCausalLM", tmp_path)
    expected, _ = _greedy_tokens(path, device, "reference")
    got, llm = _greedy_tokens(path, device, "triton")
    assert llm.instance.model.defers_norms and routed
    assert got == expected


def test_passes_past_the_deferral_limit_run_the_plain_form_on_folded_weights(tmp_path, monkeypatch):
    """Above ``defer_norms_max_rows`` a pass runs the plain form on the folded weights (the
    norms' weights of ones): the same tokens as the model that never folded. The steps of up to
    16 prompt tokens take the plain form, the decodes of 3 rows the deferred one."""
    import dataclasses

    path = make_tiny_model("LlamaForCausalLM", tmp_path)
    plain, _ = _greedy_tokens(path, "cpu", "reference")
    instance_module = importlib.import_module("ember.engine.model_instance")
    llama_module = importlib.import_module("ember.models.llama")
    limited = dataclasses.replace(reference_ops(True), defer_norms_max_rows=8)
    monkeypatch.setattr(instance_module, "select_ops", lambda *a, **k: limited)
    forms = []
    start_stream = llama_module.start_stream

    def spy(ops, hidden, eps, deferred):
        forms.append((hidden.shape[0], deferred))
        return start_stream(ops, hidden, eps, deferred)

    monkeypatch.setattr(llama_module, "start_stream", spy)
    mixed, llm = _greedy_tokens(path, "cpu", "reference")
    assert llm.instance.model.defers_norms
    assert {deferred for rows, deferred in forms} == {True, False}
    assert all(deferred == (rows <= 8) for rows, deferred in forms)
    assert mixed == plain


def test_folding_in_row_blocks_gives_the_whole_matrix_fold(tmp_path, monkeypatch):
    """The norm weights fold into their projections a few rows at a time (the load runs after
    the KV cache took the free memory): the same weights as one whole-matrix fold."""
    from ember.models import llama

    path = make_tiny_model("LlamaForCausalLM", tmp_path, num_hidden_layers=1)
    instance_module = importlib.import_module("ember.engine.model_instance")
    monkeypatch.setattr(instance_module, "select_ops", lambda *a, **k: reference_ops(True))
    whole = LLM(str(path), device="cpu", max_model_len=64).instance.model
    monkeypatch.setattr(llama, "_FOLD_ROWS", 5)
    blocks = LLM(str(path), device="cpu", max_model_len=64).instance.model
    assert whole.defers_norms and blocks.defers_norms
    for (name, ours), theirs in zip(
        blocks.state_dict().items(), whole.state_dict().values(), strict=True
    ):
        assert torch.equal(ours, theirs), name
