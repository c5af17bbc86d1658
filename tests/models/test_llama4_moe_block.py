"""`Llama4MoeBlock` on the reference ops gives transformers' `Llama4TextMoe` bits, in float32
and bf16: the top-1 expert fed the token scaled by its score, plus the shared expert; the
experts loaded from transformers' [E, in, out] stacks."""

from __future__ import annotations

import pytest
import torch

from ember.config import ModelConfig
from ember.layers.ops import reference_ops
from ember.layers.residual import ResidualStream
from ember.models.llama4 import Llama4MoeBlock

transformers = pytest.importorskip("transformers")

T, H, I, E = 50, 64, 32, 8


def hf_block(dtype: torch.dtype):
    config = transformers.Llama4TextConfig(
        hidden_size=H,
        intermediate_size=I,
        num_local_experts=E,
        num_experts_per_tok=1,
        num_hidden_layers=1,
        num_attention_heads=4,
        head_dim=16,
    )
    module = transformers.models.llama4.modeling_llama4.Llama4TextMoe(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.2)
    return config, module.to(dtype).eval()


def ember_block(config, hf, dtype: torch.dtype) -> Llama4MoeBlock:
    """The block with transformers' weights, placed as a checkpoint's are."""
    cfg = ModelConfig.from_hf_dict({**config.to_dict(), "architectures": ["Llama4ForCausalLM"]})
    block = Llama4MoeBlock(cfg, reference_ops()).to(dtype)
    experts, shared = hf.experts, hf.shared_expert
    with torch.no_grad():
        block.gate.weight.copy_(hf.router.weight)
        block.w13.copy_(experts.gate_up_proj.transpose(1, 2))
        block.w2.copy_(experts.down_proj.transpose(1, 2))
        gate_up = torch.cat([shared.gate_proj.weight, shared.up_proj.weight])
        block.shared_expert.gate_up_proj.weight.copy_(gate_up)
        block.shared_expert.down_proj.weight.copy_(shared.down_proj.weight)
    return block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_block_gives_transformers_bits(dtype):
    config, hf = hf_block(dtype)
    block = ember_block(config, hf, dtype)
    ops = reference_ops()
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    ones = torch.ones(H, dtype=dtype)
    with torch.no_grad():
        expected, _ = hf(ops.rms_norm(x, ones, 1e-5))  # the block reads the normalised stream
        out = block(ResidualStream(x, 1e-5), ones).pending
    assert torch.equal(out, expected)


def test_the_experts_input_is_scaled_not_their_output():
    """Scaling the chosen expert's output instead (Mixtral's way) gives other values: the test
    above tells the two apart."""
    config, hf = hf_block(torch.float32)
    block = ember_block(config, hf, torch.float32)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, _ = hf(x)
        logits = torch.nn.functional.linear(x, block.gate.weight)
        top, ids = logits.topk(1, dim=-1)
        weighted = reference_ops().moe_experts(x, block.w13, block.w2, torch.sigmoid(top), ids)
        shared = hf.shared_expert(x)
    assert not torch.allclose(weighted + shared, expected, atol=1e-3)
