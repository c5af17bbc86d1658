"""Hugging Face `config.json` and `generation_config.json` equivalents built from GGUF metadata."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
from gguf.constants import LlamaFileType

from ember.weights.gguf_rope import llama3_rope_scaling

# general.architecture -> (HF architecture, HF model_type)
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
SUPPORTED_GGUF_ARCHITECTURES = tuple(_ARCHITECTURES)
# Besides eos, llama.cpp stops on these (Llama 3 ends a turn with eot, a tool call with eom).
_STOP_TOKEN_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)


def gguf_architecture(metadata: Mapping[str, Any], path: str) -> str:
    """`general.architecture`, checked against the architectures ember can load."""
    arch = metadata.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: "
            + ", ".join(SUPPORTED_GGUF_ARCHITECTURES)
        )
    return arch


def hf_config_from_gguf(
    metadata: Mapping[str, Any],
    tensor_names: Collection[str],
    vocab_size: int,
    rope_divisors: np.ndarray | None,
    path: str,
) -> dict[str, Any]:
    """A config.json-style dict. `vocab_size` is the embedding's row count; `rope_divisors`
    is the `rope_freqs` tensor when the file has one."""
    arch = gguf_architecture(metadata, path)
    hf_arch, model_type = _ARCHITECTURES[arch]
    # llama.cpp writes Mistral models as "llama"; transformers tells them apart by name.
    if arch == "llama" and "mistral" in str(metadata.get("general.name", "")).lower():
        hf_arch, model_type = "MistralForCausalLM", "mistral"

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{name}", default)

    def required(name: str) -> int:
        if key(name) is None:
            raise ValueError(f"{path}: missing GGUF metadata key {arch}.{name}")
        return int(key(name))

    hidden_size = required("embedding_length")
    num_heads = required("attention.head_count")
    head_dim = int(key("attention.key_length") or key("rope.dimension_count") or 0)
    head_dim = head_dim or hidden_size // num_heads
    rope_theta = _float32_decimal(key("rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": required("feed_forward_length"),
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _float32_decimal(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(key("context_length", 4096)),
        # llama.cpp writes no output.weight when the LM head is the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": _optional_int(metadata.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": generation_config_from_gguf(metadata)["eos_token_id"],
        "pad_token_id": _optional_int(metadata.get("tokenizer.ggml.padding_token_id")),
    }
    if (stored := _stored_float_dtype(metadata)) is not None:
        config["torch_dtype"] = stored
    rotary_dim = int(key("rope.dimension_count") or head_dim)
    rope_scaling = _rope_scaling(metadata, arch, rope_divisors, rope_theta, rotary_dim, path)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def generation_config_from_gguf(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """A generation_config.json-style dict: eos_token_id (int, or list when several) and bos."""
    stop_ids: list[int] = []
    for key in _STOP_TOKEN_KEYS:
        token_id = _optional_int(metadata.get(key))
        if token_id is not None and token_id not in stop_ids:
            stop_ids.append(token_id)
    eos: int | list[int] | None = stop_ids[0] if len(stop_ids) == 1 else (stop_ids or None)
    return {
        "bos_token_id": _optional_int(metadata.get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": eos,
        "pad_token_id": _optional_int(metadata.get("tokenizer.ggml.padding_token_id")),
    }


def _rope_scaling(
    metadata: Mapping[str, Any],
    arch: str,
    rope_divisors: np.ndarray | None,
    rope_theta: float,
    rotary_dim: int,
    path: str,
) -> dict[str, Any] | None:
    if rope_divisors is not None:
        return llama3_rope_scaling(rope_divisors, rope_theta, rotary_dim, path)
    kind = metadata.get(f"{arch}.rope.scaling.type")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind is None and (legacy_factor := metadata.get(f"{arch}.rope.scale_linear")) is not None:
        kind, factor = "linear", legacy_factor
    if kind in (None, "none"):
        return None
    # Passed through so that ModelConfig names an unsupported type instead of ignoring it.
    scaling: dict[str, Any] = {"rope_type": kind}
    if factor is not None:
        scaling["factor"] = _float32_decimal(factor)
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _stored_float_dtype(metadata: Mapping[str, Any]) -> str | None:
    # An unquantized file keeps its float type (GPU loads default to it); a quantized one has none.
    names = {
        LlamaFileType.ALL_F32: "float32",
        LlamaFileType.MOSTLY_F16: "float16",
        LlamaFileType.MOSTLY_BF16: "bfloat16",
    }
    return names.get(metadata.get("general.file_type"))


def _float32_decimal(value: float) -> float:
    # GGUF stores float32: 1e-05 reads back as 9.999999747378752e-06; keep the written decimal.
    return float(str(np.float32(value)))


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
