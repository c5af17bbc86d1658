"""GGUF tensor names and layouts mapped back to Hugging Face's.

llama.cpp renames every tensor (`blk.3.attn_q.weight`) and, for llama-architecture models only,
reorders the rows of the Q and K projections so that its interleaved ("GPT-J") RoPE kernel sees
each rotated pair side by side. HF's Llama rotates halves ("rotate_half"), so we undo that.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp derives from the config (llama3 RoPE factors); HF recomputes them.
DERIVED_TENSORS = frozenset({"rope_freqs.weight"})

_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_PATTERN = re.compile(r"(\w+)\.(weight|bias)")
# Architectures whose llama.cpp converter permutes Q/K rows (the others use NeoX-style RoPE).
_ROPE_PERMUTED_ARCHITECTURES = frozenset({"llama"})


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF state-dict name for a GGUF tensor name, or None if it has no HF counterpart."""
    if match := _LAYER_PATTERN.fullmatch(gguf_name):
        layer, module, kind = match.groups()
        hf_module = _LAYER_NAMES.get(module)
        return f"model.layers.{layer}.{hf_module}.{kind}" if hf_module else None
    if match := _GLOBAL_PATTERN.fullmatch(gguf_name):
        module, kind = match.groups()
        hf_module = _GLOBAL_NAMES.get(module)
        return f"{hf_module}.{kind}" if hf_module else None
    return None


def rope_permuted_heads(
    architecture: str, hf_name: str, num_heads: int, num_kv_heads: int
) -> int | None:
    """How many heads to un-permute the rows of `hf_name` over, or None if it is not permuted."""
    if architecture not in _ROPE_PERMUTED_ARCHITECTURES:
        return None
    if ".self_attn.q_proj." in hf_name:
        return num_heads
    if ".self_attn.k_proj." in hf_name:
        return num_kv_heads
    return None


def undo_rope_permutation(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's Q/K row permutation, for a weight [out, in] or a bias [out].

    Within each head llama.cpp stores row pairs (i, i + head_dim/2) next to each other; rows
    go back to HF's order by viewing each head as [head_dim/2, 2] and transposing to
    [2, head_dim/2].
    """
    rows, rest = tensor.shape[0], tensor.shape[1:]
    half = rows // num_heads // 2
    by_head = tensor.reshape(num_heads, half, 2, *rest)
    return by_head.transpose(1, 2).reshape(tensor.shape).contiguous()
