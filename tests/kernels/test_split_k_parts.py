"""Split-K partial sums reduced in the next norm: `add_parts_rms_norm` (kernel against the
reference), `linear_parts`' routing, and the engine's plain residual form carrying partial sums
(reference data flow on the CPU; the batched cuBLAS product itself in tests/gpu)."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.kernels.linear import LinearRouter
from ember.kernels.rmsnorm import add_parts_rms_norm
from ember.kernels.tuning import LinearRoutes
from ember.layers.ops import reference_ops
from ember.layers.reference_ops import (
    add_parts_rms_norm_reference,
    fused_add_rms_norm_reference,
    linear_parts_reference,
)

EPS = 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_parts", [1, 2, 3])
def test_add_parts_rms_norm_kernel_matches_the_reference(gen, device, dtype, num_parts):
    rows, hidden = 7, 1000  # not a power of two: masked columns
    parts = torch.randn(num_parts, rows, hidden, generator=gen) * 2
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype)
    expected_residual = residual.clone()
    expected = add_parts_rms_norm_reference(expected_residual, parts, weight, EPS)

    got_residual = residual.to(device)
    got = add_parts_rms_norm(got_residual, parts.to(device), weight.to(device), EPS)
    # The parts summed in order and rounded once, then one rounded add: the same bits.
    assert torch.equal(got_residual.cpu(), expected_residual)
    assert got.dtype == dtype and got.shape == (rows, hidden)
    if dtype == torch.float32:
        torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got.cpu().float(), expected.float(), atol=1e-2, rtol=1e-2)
        assert (got.cpu() == expected).float().mean() > 0.99


def test_one_part_is_the_fused_add_norm(gen):
    """A single float32 part is an un-split product: the same result as the fused add + norm of
    that product rounded to the dtype."""
    product = torch.randn(4, 64, generator=gen)
    residual = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    weight = torch.ones(64, dtype=torch.bfloat16)
    residual_a, residual_b = residual.clone(), residual.clone()
    normed = add_parts_rms_norm_reference(residual_a, product[None], weight, EPS)
    x = product.to(torch.bfloat16)
    fused_add_rms_norm_reference(x, residual_b, weight, EPS)
    assert torch.equal(residual_a, residual_b) and torch.equal(normed, x)


def test_add_parts_rms_norm_rejects_misshapen_parts(device):
    residual = torch.zeros(3, 32, device=device)
    weight = torch.ones(32, device=device)
    with pytest.raises(ValueError, match="float32"):
        add_parts_rms_norm(
            residual, torch.zeros(2, 3, 32, dtype=torch.float16, device=device), weight, EPS
        )
    with pytest.raises(ValueError, match=r"\[P, T, H\]"):
        add_parts_rms_norm(residual, torch.zeros(2, 4, 32, device=device), weight, EPS)


def test_linear_parts_reference_sums_to_the_product(gen):
    x = torch.randn(5, 96, generator=gen)
    weight = torch.randn(40, 96, generator=gen)
    parts = linear_parts_reference(x, weight, 3)
    assert parts.shape == (3, 5, 40) and parts.dtype == torch.float32
    torch.testing.assert_close(parts.sum(0), x @ weight.T, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(parts[1], x[:, 32:64] @ weight[:, 32:64].T)


def test_split_k_routing():
    """Products no wider than their input, at the routes' rows, split into as many parts as
    keep each slice whole 16-byte rows and at least the routes' minimum width."""
    routes = LinearRoutes(split_k_rows=(65, 256), split_k_max_parts=4, split_k_min_part_k=2048)
    split_k_parts = LinearRouter(routes).split_k_parts
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert split_k_parts(256, 4096, 14336, bf16, cuda) == 4  # down: 3,584 columns a slice
    assert split_k_parts(256, 4096, 4096, bf16, cuda) == 2  # o: no slice under 2,048
    assert split_k_parts(65, 4096, 4096, bf16, cuda) == 2
    assert split_k_parts(64, 4096, 4096, bf16, cuda) == 1  # below the routes' rows
    assert split_k_parts(257, 4096, 4096, bf16, cuda) == 1
    assert split_k_parts(256, 6144, 4096, bf16, cuda) == 1  # wider than its input (q/k/v)
    assert split_k_parts(256, 4096, 4096, torch.float32, cuda) == 1
    assert split_k_parts(256, 4096, 4096, bf16, torch.device("cpu")) == 1
    assert split_k_parts(256, 1000, 4100, bf16, cuda) == 1  # slices of 2,050: not 16-byte rows
    off = dataclasses.replace(routes, split_k_max_parts=1)
    assert LinearRouter(off).split_k_parts(256, 4096, 14336, bf16, cuda) == 1  # switched off


def _greedy_tokens(path):
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (4, 19, 33)]
    llm = LLM(
        str(path),
        device="cpu",
        max_model_len=64,
        backend="reference",
        dtype="float32",
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=16 << 20,
    )
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def test_the_model_on_partial_sums_gives_the_plain_tokens(tmp_path, monkeypatch):
    """Every plain-form sub-block output left as two partial sums (the reference's data flow,
    so no interpreter) and reduced in the next add + norm, the final norm included: the tokens
    of the model that never splits."""
    path = make_tiny_model("LlamaForCausalLM", tmp_path)
    plain = _greedy_tokens(path)
    split = reference_ops(split_k_parts=2)
    reduced = []

    def spy(residual, parts, weight, eps):
        reduced.append(parts.shape)
        return add_parts_rms_norm_reference(residual, parts, weight, eps)

    instance_module = importlib.import_module("ember.engine.model_instance")
    ops = dataclasses.replace(split, add_parts_rms_norm=spy)
    monkeypatch.setattr(instance_module, "select_ops", lambda *a, **k: ops)
    assert _greedy_tokens(path) == plain
    assert reduced and all(shape[0] == 2 for shape in reduced)
