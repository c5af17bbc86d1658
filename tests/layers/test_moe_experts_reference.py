"""`moe_experts_reference`, the specification the fused MoE kernel is checked against
(docs/CONTRACTS.md, "Mixture of experts"): each token's routed experts, weighted and summed,
as a per-token loop computes them and as transformers' expert modules do; FP8 experts as their
dequantized weights."""

from __future__ import annotations

import pytest
import torch

from ember.layers.fp8 import Fp8Weight, dense_weight, quantize_rows
from ember.layers.reference_ops import moe_experts_reference

transformers = pytest.importorskip("transformers")

T, H, INTER, E, K = 12, 32, 24, 8, 2


def experts(bias: bool = False, seed: int = 0, scale: float = 0.3):
    """``(w13, w2, b13, b2)`` of E random experts (biases None unless ``bias``)."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * scale
    w2 = torch.randn(E, H, INTER, generator=g) * scale
    if not bias:
        return w13, w2, None, None
    return w13, w2, torch.randn(E, 2 * INTER, generator=g), torch.randn(E, H, generator=g)


def routing(ids: list[list[int]], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights, topk_ids)`` for the given experts per token, random positive weights."""
    g = torch.Generator().manual_seed(seed)
    topk_ids = torch.tensor(ids, dtype=torch.int32)
    return torch.rand(topk_ids.shape, generator=g) + 0.1, topk_ids


def random_ids(num_tokens: int, choices: list[int], seed: int = 2) -> list[list[int]]:
    """``K`` distinct experts per token, from ``choices``."""
    g = torch.Generator().manual_seed(seed)
    return [
        [choices[i] for i in torch.randperm(len(choices), generator=g)[:K].tolist()]
        for _ in range(num_tokens)
    ]


def per_token_loop(x, w13, w2, weights, ids, activation="silu", b13=None, b2=None):
    """The contract read literally, one token and one of its experts at a time, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            if b13 is not None:
                h = h + b13[e].double()
            gate, up = h[:INTER], h[INTER:]
            if activation == "silu":
                act = gate * torch.sigmoid(gate) * up
            else:
                gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
                act = (up + 1) * gate * torch.sigmoid(1.702 * gate)
            y = w2[e].double() @ act
            if b2 is not None:
                y = y + b2[e].double()
            out[t] += float(weights[t, j]) * y
    return out


def tokens(num_tokens: int = T, seed: int = 3, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("activation", ["silu", "swiglu_oai"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_matches_a_per_token_loop(activation, bias):
    x = tokens()
    w13, w2, b13, b2 = experts(bias)
    weights, ids = routing(random_ids(T, list(range(E))))
    out = moe_experts_reference(x, w13, w2, weights, ids, activation, b13, b2)
    expected = per_token_loop(x, w13, w2, weights, ids, activation, b13, b2)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_every_token_routed_to_one_expert():
    x = tokens()
    w13, w2, _, _ = experts()
    others = [0, 1, 2, 3, 4, 6, 7]
    weights, topk_ids = routing([[5, others[t % len(others)]] for t in range(T)])
    out = moe_experts_reference(x, w13, w2, weights, topk_ids)
    torch.testing.assert_close(
        out.double(), per_token_loop(x, w13, w2, weights, topk_ids), atol=1e-5, rtol=1e-5
    )


def test_experts_no_token_chose_are_never_read():
    """Only the chosen experts' weights are read: the others may hold anything, even NaN."""
    x = tokens()
    w13, w2, _, _ = experts()
    used = [1, 4, 6]
    weights, ids = routing(random_ids(T, used))
    expected = per_token_loop(x, w13, w2, weights, ids)
    for e in set(range(E)) - set(used):
        w13[e], w2[e] = float("nan"), float("nan")
    out = moe_experts_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_a_zero_weight_contributes_nothing():
    x = tokens()
    w13, w2, _, _ = experts()
    weights, ids = routing(random_ids(T, list(range(E))))
    weights[:, 1] = 0.0
    only_first = moe_experts_reference(x, w13, w2, weights[:, :1], ids[:, :1])
    torch.testing.assert_close(moe_experts_reference(x, w13, w2, weights, ids), only_first)


def test_bf16_rounds_once_after_a_float32_sum():
    x = tokens().bfloat16()
    w13, w2, _, _ = experts()
    weights, ids = routing(random_ids(T, list(range(E))))
    out = moe_experts_reference(x, w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert out.dtype == torch.bfloat16
    expected = per_token_loop(x, w13.bfloat16(), w2.bfloat16(), weights, ids)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_are_dequantized_expert_by_expert(dtype):
    """`Fp8Weight` experts compute exactly what their weights dequantized to the activations'
    dtype compute; an expert no token chose is not dequantized (its scales may be NaN)."""
    x = tokens().to(dtype)
    w13, w2, _, _ = experts()
    fp8 = [Fp8Weight(*quantized(w)) for w in (w13, w2)]
    weights, ids = routing(random_ids(T, [0, 2, 3, 7]))
    expected = moe_experts_reference(x, *(dense_weight(w, dtype) for w in fp8), weights, ids)
    for unused in (1, 4):
        fp8[0].scale[unused] = float("nan")
    out = moe_experts_reference(x, *fp8, weights, ids)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def quantized(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    weight, scale = quantize_rows(stacked.reshape(-1, stacked.shape[-1]))
    return weight.view(stacked.shape), scale.view(stacked.shape[:2])


def test_swiglu_oai_clamps_large_gate_and_up_values():
    """Inputs large enough that gate and up values pass the clamp: the clamped formula, not
    the plain one, is what comes out."""
    x = tokens(scale=8.0)
    w13, w2, b13, b2 = experts(bias=True)
    weights, ids = routing(random_ids(T, list(range(E))))
    h = torch.einsum("eih,th->tei", w13, x)
    assert (h[..., :INTER] > 7).any() and (h[..., INTER:].abs() > 7).any()
    out = moe_experts_reference(x, w13, w2, weights, ids, "swiglu_oai", b13, b2)
    expected = per_token_loop(x, w13, w2, weights, ids, "swiglu_oai", b13, b2)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-5)


def test_an_unknown_activation_is_refused():
    x = tokens()
    w13, w2, _, _ = experts()
    weights, ids = routing(random_ids(T, list(range(E))))
    with pytest.raises(ValueError, match="unknown expert activation 'gelu'"):
        moe_experts_reference(x, w13, w2, weights, ids, "gelu")


# -- against transformers' expert modules ---------------------------------------------------------


def test_equals_transformers_mixtral_experts():
    """Mixtral (and Qwen3-MoE, the same module) hold experts in the ops' layout already."""
    config = transformers.MixtralConfig(
        hidden_size=H, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=K
    )
    config._experts_implementation = "eager"
    hf = transformers.models.mixtral.modeling_mixtral.MixtralExperts(config)
    w13, w2, _, _ = experts()
    hf.gate_up_proj.data.copy_(w13)
    hf.down_proj.data.copy_(w2)
    x = tokens()
    weights, ids = routing(random_ids(T, list(range(E))))
    with torch.no_grad():
        expected = hf(x, ids.long(), weights)
    torch.testing.assert_close(moe_experts_reference(x, w13, w2, weights, ids), expected)


def test_swiglu_oai_equals_transformers_gpt_oss_experts():
    """gpt-oss stores gate_up transposed and interleaved (gate, up, gate, ...), with biases: in
    the ops' layout, the same experts give the same outputs."""
    config = transformers.GptOssConfig(
        hidden_size=H, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=K
    )
    config._experts_implementation = "eager"
    hf = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config)
    w13, w2, b13, b2 = experts(bias=True)
    gate_up = torch.empty(E, H, 2 * INTER)
    gate_up[..., 0::2], gate_up[..., 1::2] = w13[:, :INTER].mT, w13[:, INTER:].mT
    gate_up_bias = torch.empty(E, 2 * INTER)
    gate_up_bias[:, 0::2], gate_up_bias[:, 1::2] = b13[:, :INTER], b13[:, INTER:]
    hf.gate_up_proj.data.copy_(gate_up)
    hf.gate_up_proj_bias.data.copy_(gate_up_bias)
    hf.down_proj.data.copy_(w2.mT)
    hf.down_proj_bias.data.copy_(b2)
    x = tokens(scale=8.0)  # past the clamps
    weights, ids = routing(random_ids(T, list(range(E))))
    with torch.no_grad():
        expected = hf(x, router_indices=ids.long(), routing_weights=weights)
    out = moe_experts_reference(x, w13, w2, weights, ids, "swiglu_oai", b13, b2)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
