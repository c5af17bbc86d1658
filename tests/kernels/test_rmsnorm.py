"""RMSNorm and fused residual-add + RMSNorm: reference vs transformers, kernel vs reference."""

from __future__ import annotations

import pytest
import torch

from ember.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from ember.layers.reference_ops import fused_add_rms_norm_reference, rms_norm_reference

EPS = 1e-5


def _hf_norm(hidden, dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(hidden, eps=EPS).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_matches_transformers(gen, dtype):
    norm = _hf_norm(96, dtype)
    x = torch.randn(5, 96, generator=gen).to(dtype)
    residual = torch.randn(5, 96, generator=gen).to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm_reference(x, norm.weight, EPS), norm(x))
        expected_residual = residual + x  # HF's decoder layer adds in the model dtype
        expected = norm(expected_residual)
    fused_add_rms_norm_reference(x, residual, norm.weight.detach(), EPS)
    assert torch.equal(residual, expected_residual)
    assert torch.equal(x, expected)


def assert_close_norm(got, expected, dtype):
    """fp32: tight. Half types: the kernel sums squares in another order, so a value may round
    to the neighbouring half-precision number; nearly all must still be identical."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=1e-2)
    assert (got == expected).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [96, 4096])  # short rows share a program; long rows don't
def test_rms_norm_kernel(gen, device, dtype, hidden):
    x = torch.randn(7, hidden, generator=gen).to(dtype)
    weight = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype)
    out = torch.full_like(x, float("nan"), device=device)
    rms_norm(x.to(device), weight.to(device), EPS, out=out)
    assert_close_norm(out.cpu(), rms_norm_reference(x, weight, EPS), dtype)


def test_rms_norm_per_head_on_strided_view(gen, device):
    """Qwen3's q-norm: rows are the heads of a q slice of a fused qkv buffer."""
    tokens, heads, head_dim = 5, 4, 64
    qkv = torch.randn(tokens, (heads + 2) * head_dim, generator=gen).to(torch.bfloat16)
    weight = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(torch.bfloat16)
    q = qkv.to(device)[:, : heads * head_dim].view(tokens, heads, head_dim)
    got = rms_norm(q, weight.to(device), EPS)
    assert got.shape == q.shape and got.is_contiguous()
    expected = rms_norm_reference(qkv[:, : heads * head_dim].reshape(-1, head_dim), weight, EPS)
    assert_close_norm(got.cpu().view(-1, head_dim), expected, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_kernel(gen, device, dtype):
    hidden = 1000  # not a power of two: masked columns
    x = torch.randn(6, hidden, generator=gen).to(dtype)
    residual = torch.randn(6, hidden, generator=gen).to(dtype)
    weight = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype)
    expected_x, expected_residual = x.clone(), residual.clone()
    fused_add_rms_norm_reference(expected_x, expected_residual, weight, EPS)

    got_x, got_residual = x.to(device), residual.to(device)
    fused_add_rms_norm(got_x, got_residual, weight.to(device), EPS)
    assert torch.equal(got_residual.cpu(), expected_residual)  # one rounded add: exact
    assert_close_norm(got_x.cpu(), expected_x, dtype)
