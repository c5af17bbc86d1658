"""`ember bench make-model`: write a random-weight checkpoint of a known shape to disk.

GPU and load-time benchmarks need a real HF directory (config.json, sharded safetensors, a
tokenizer) with the shape of a real model, and nothing may be downloaded. The tokenizer is
SmolLM2's, rebuilt from the GGUF file we ship; its ids fit in every preset's vocabulary.
Output-projection rows past the tokenizer's ids are zero, so greedy decoding (whose random
logits have a positive maximum) stays on ids that decode to text, as a real model's would;
the GEMM keeps the preset's full shape and cost. A preset names its architecture where it is
not Llama's; the tensors written are those ember reads for it (its `CheckpointLayout`), a
mixture of experts' one tensor per expert, as transformers saves them (Llama 4's stacked per
layer in bf16, as transformers saves them, and one tensor per expert in FP8, as llm-compressor
writes them).

The gpt-oss presets have OpenAI's published shapes (config.json as published, but for the
tokenizer's special ids) and write the experts in transformers' layout in bf16;
``--quantization mxfp4`` writes them as OpenAI publishes them instead, MXFP4 blocks and scales
(`ember.weights.mxfp4`) under ``quant_method: mxfp4``.

``--quantization fp8`` writes the decoder's linear weights as llm-compressor's "FP8_DYNAMIC"
checkpoints hold them (the compressed-tensors layout): float8 e4m3 with a ``weight_scale`` per
output channel ``[out, 1]`` in the model's dtype, activations dynamic per token, the output head
left in bf16; a mixture of experts' every expert so too, its routers left in bf16 (named in the
config's ``ignore``, as llm-compressor's MoE recipes leave them); so the GPU benchmarks load
the FP8 form users load. (Llama 4's attention is FP8 too, where llm-compressor's Llama 4
recipes leave it in bf16: the benchmarks measure the all-FP8 form.)

``--config-only`` writes config.json, generation_config.json and the tokenizer files but no
weight: what ``--load-format dummy`` (`ember.weights.dummy_weights`) needs to run a shape
whose checkpoint does not fit the disk.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from ember.layers.fp8 import FP8_DTYPE, FP8_E4M3_MAX
from ember.weights.mxfp4 import quantize_mxfp4

# Ids the SmolLM2 tokenizer defines; rows of the output projection past them are zero.
TOKENIZER_VOCAB = 49152


def _gpt_oss(num_layers: int, num_experts: int, **shape) -> dict:
    """A gpt-oss config.json's fields (OpenAI's published values) for a model of
    ``num_layers`` layers of ``num_experts`` experts; ``shape`` overrides them."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": num_experts,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "initial_context_length": 4096,
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "sliding_window": 128,
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        ],
        "attention_bias": True,
        "rms_norm_eps": 1e-5,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        **shape,
    }


PRESETS: dict[str, dict] = {
    "llama-3.1-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    # Llama-3.1-70B's shape: 141 GB in bf16, served split over GPUs (-tp) with
    # --load-format dummy from `make-model --config-only` (its weights would not fit the disk).
    "llama-3.1-70b": {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "llama-3.2-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
    # Mixtral-8x7B-v0.1's shapes, but for its vocabulary: padded from 32000 ids to the
    # tokenizer's 49152 (0.14 B parameters more of 46.7 B), so every id the tokenizer makes is
    # in the model's vocabulary.
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": TOKENIZER_VOCAB,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    # Llama-4-Scout-17B-16E's text model (as its published config.json's text_config has it):
    # 16 experts and a shared expert on every layer, one expert per token; chunked attention
    # (8192 keys) with the QK L2 norm on three layers of four, NoPE with temperature tuning on
    # the fourth.
    "llama-4-scout-17b-16e": {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "hidden_size": 5120,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_local_experts": 16,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1,
        "vocab_size": 202048,
        "max_position_embeddings": 10485760,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        "attention_chunk_size": 8192,
        "use_qk_norm": True,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
        "tie_word_embeddings": False,
    },
    "gpt-oss-20b": _gpt_oss(num_layers=24, num_experts=32),
    "gpt-oss-120b": _gpt_oss(num_layers=36, num_experts=128),
    "tiny": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    "tiny-qwen3-moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 256,
        "intermediate_size": 768,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    "tiny-mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 256,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
    },
    # Scout's layout at a small size: experts on every other layer (dense MLPs between), chunks
    # of 128 keys, temperature tuning from position 63 on, so short prompts reach all three.
    "tiny-llama4": {
        "architectures": ["Llama4ForCausalLM"],
        "model_type": "llama4_text",
        "hidden_size": 256,
        "intermediate_size": 128,
        "intermediate_size_mlp": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "attention_chunk_size": 128,
        "use_qk_norm": True,
        "attn_temperature_tuning": True,
        "floor_scale": 64,
        "attn_scale": 0.1,
        "tie_word_embeddings": False,
    },
    "tiny-gpt-oss": _gpt_oss(
        num_layers=4,
        num_experts=8,
        hidden_size=256,
        intermediate_size=256,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        num_experts_per_tok=2,
        experts_per_token=2,
        vocab_size=49152,
        sliding_window=16,
    ),
}

# The presets whose every MLP is dense (the others are mixtures of experts).
DENSE_PRESETS = tuple(
    name
    for name, preset in PRESETS.items()
    if not any(key in preset for key in ("num_experts", "num_local_experts"))
)

_SHARD_BYTES = 4 << 30
QUANTIZATIONS = ("fp8", "mxfp4")
# config.json's quantization_config of OpenAI's gpt-oss checkpoints: the experts in MXFP4.
GPT_OSS_MXFP4 = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
# gpt-oss's expert weights, which its MXFP4 checkpoints hold as blocks and scales.
_MXFP4_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

# config.json's quantization_config of an llm-compressor FP8_DYNAMIC checkpoint: FP8 weights
# with a scale per output channel, FP8 activations quantized per token at run time.
_FP8_ARGS = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
COMPRESSED_TENSORS_FP8 = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {**_FP8_ARGS, "strategy": "channel", "dynamic": False},
            "input_activations": {**_FP8_ARGS, "strategy": "token", "dynamic": True},
            "output_activations": None,
        }
    },
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
}


def hf_config(preset: str, quantization: str | None = None) -> dict:
    shape = dict(PRESETS[preset])
    architecture = shape.get("architectures", ["LlamaForCausalLM"])[0]
    quantized = {
        "fp8": {"quantization_config": _fp8_config(architecture)},
        "mxfp4": {"quantization_config": GPT_OSS_MXFP4},
    }.get(quantization or "", {})
    return {
        **quantized,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        **shape,
    }


def _fp8_config(architecture: str) -> dict:
    """`COMPRESSED_TENSORS_FP8`, leaving a mixture of experts' routers in float too."""
    from ember.models.registry import model_class

    config = copy.deepcopy(COMPRESSED_TENSORS_FP8)
    router_module = getattr(model_class(architecture), "router_module", None)
    if router_module is not None:
        config["ignore"].append(f"re:.*{router_module()}$")
    return config


_WEIGHT_SCALE = ".weight_scale"


def _layout(cfg: dict):
    """The tensors ember reads from a checkpoint of ``cfg``, in the form its
    ``quantization_config`` gives (Llama 4's experts: stacked in float, one by one in FP8)."""
    from ember.config import ModelConfig
    from ember.models.registry import model_class
    from ember.quantization import fp8_scheme

    model_config = dataclasses.replace(ModelConfig.from_hf_dict(cfg), fp8=fp8_scheme(cfg))
    return model_class(model_config.architecture).checkpoint_layout(model_config)


def fp8_weight_names(cfg: dict) -> frozenset[str]:
    """The weights an FP8 checkpoint of ``cfg`` (its ``quantization_config``) holds in FP8: those
    ember reads a ``weight_scale`` beside."""
    return frozenset(
        name.removesuffix(_WEIGHT_SCALE) + ".weight"
        for name in _layout(cfg).names()
        if name.endswith(_WEIGHT_SCALE)
    )


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """HF names and shapes of every tensor of a checkpoint with this config: those ember reads
    for its architecture, but an FP8 weight's scale (written beside its weight)."""
    layout = _layout(cfg)
    return [
        (name, layout.shape_of(name)) for name in layout.names() if not name.endswith(_WEIGHT_SCALE)
    ]


def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, device: str):
    if name.endswith(("bias", "sinks")):  # biases and attention sinks: small
        return 0.05 * torch.randn(shape, generator=gen, device=device)
    if len(shape) == 1:  # norms: around 1 so activations keep their scale
        return 1.0 + 0.05 * torch.randn(shape, generator=gen, device=device)
    fan_in = shape[1]
    std = 1.0 / fan_in**0.5 if "embed_tokens" not in name else 1.0
    return std * torch.randn(shape, generator=gen, device=device)


def fp8_channel_quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight, weight_scale)`` as an FP8_DYNAMIC checkpoint stores them: float8 e4m3, and a
    bf16 scale per row ``[out, 1]`` mapping the row's largest magnitude onto 448 (the weight
    divided by that stored scale)."""
    scale = (weight.float().abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX).to(torch.bfloat16)
    scale = scale.clamp(min=torch.finfo(torch.bfloat16).tiny)
    quantized = (weight.float() / scale.float()).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return quantized.to(FP8_DTYPE), scale


def mxfp4_experts(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """gpt-oss's stacked expert weight ``name`` (transformers' layout: [E, in, out]) as MXFP4
    blocks and scales over its input columns, an expert at a time."""
    quantized = [quantize_mxfp4(expert.T) for expert in weight]
    return {
        f"{name}_blocks": torch.stack([blocks for blocks, _ in quantized]),
        f"{name}_scales": torch.stack([scales for _, scales in quantized]),
    }


def make_model(
    preset: str,
    out: Path,
    seed: int = 0,
    device: str | None = None,
    tokenizer_dir: Path | None = None,
    quantization: str | None = None,
    config_only: bool = False,
) -> Path:
    """Write the checkpoint into `out`; returns it. Random bf16 weights, drawn on `device`;
    ``quantization`` "fp8": the decoder's linear weights in FP8 (the module docstring);
    ``config_only``: the config and tokenizer files alone, no weight."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {QUANTIZATIONS}")
    gpt_oss = PRESETS[preset].get("architectures") == ["GptOssForCausalLM"]
    if (quantization == "mxfp4" and not gpt_oss) or (quantization == "fp8" and gpt_oss):
        raise ValueError(f"{preset}: --quantization {quantization} is not made for this preset")
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(preset, quantization)
    if not config_only:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        generator = torch.Generator(device=device).manual_seed(seed)
        _write_weights(cfg, out, generator, device, quantization)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]})
    )
    _write_tokenizer(out, tokenizer_dir)
    return out


def _write_weights(
    cfg: dict, out: Path, gen: torch.Generator, device: str, quantization: str | None
) -> None:
    """The random weights of ``cfg`` in shards of at most `_SHARD_BYTES`, with their index;
    ``quantization`` "fp8" or "mxfp4" as `make_model` takes it."""
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, shard_index, total = 0, 0, 0
    in_fp8 = fp8_weight_names(cfg) if quantization == "fp8" else frozenset()

    def flush() -> None:
        nonlocal shard, shard_bytes, shard_index
        if not shard:
            return
        shard_index += 1
        name = f"model-{shard_index:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard, shard_bytes = {}, 0

    output_rows = "model.embed_tokens.weight" if cfg["tie_word_embeddings"] else "lm_head.weight"
    for name, shape in tensor_shapes(cfg):
        tensor = random_tensor(name, shape, gen, device)
        if name == output_rows:
            tensor[TOKENIZER_VOCAB:] = 0
        tensor = tensor.to(torch.bfloat16)
        tensors = {name: tensor}
        if name in in_fp8:
            weight, scale = fp8_channel_quantized(tensor)
            tensors = {name: weight, name.removesuffix("weight") + "weight_scale": scale}
        if quantization == "mxfp4" and name.endswith(_MXFP4_TENSORS):
            tensors = mxfp4_experts(name, tensor)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if shard_bytes + nbytes > _SHARD_BYTES:
            flush()
        shard.update((key, value.cpu()) for key, value in tensors.items())
        shard_bytes += nbytes
        total += nbytes
    flush()
    count = shard_index
    renamed = {}
    for i in range(1, count + 1):
        old = out / f"model-{i:05d}.safetensors"
        new = out / f"model-{i:05d}-of-{count:05d}.safetensors"
        old.rename(new)
        renamed[old.name] = new.name
    index = {
        "metadata": {"total_size": total},
        "weight_map": {k: renamed[v] for k, v in weight_map.items()},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_tokenizer(out: Path, tokenizer_dir: Path | None) -> None:
    if tokenizer_dir is not None:  # saved tokenizer files, e.g. on a machine without the GGUF
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (tokenizer_dir / name).is_file():
                shutil.copy(tokenizer_dir / name, out / name)
        return
    from ember.weights.default_model import default_model_path
    from ember.weights.gguf_checkpoint import GGUFCheckpoint

    source = GGUFCheckpoint(default_model_path())
    source.tokenizer.save(str(out / "tokenizer.json"))
    tok_cfg = dict(source.tokenizer_config)
    tok_cfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.1-8b")
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="where to draw the weights (default: cuda)")
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        help="fp8: the decoder's linear weights (every expert's too) in float8 e4m3 with a "
        "bf16 scale per output channel, in the compressed-tensors layout of llm-compressor's "
        "FP8_DYNAMIC checkpoints; mxfp4 (gpt-oss presets): the experts in MXFP4, as OpenAI "
        "publishes them",
    )
    parser.add_argument(
        "--config-only",
        action="store_true",
        help="write config.json and the tokenizer files but no weight: for `--load-format "
        "dummy`, which makes the weights on the device",
    )
    parser.add_argument(
        "--tokenizer-dir",
        type=Path,
        default=None,
        help="copy tokenizer files from here instead of rebuilding SmolLM2's from its GGUF",
    )


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    path = make_model(
        args.preset,
        args.out,
        args.seed,
        args.device,
        args.tokenizer_dir,
        args.quantization,
        args.config_only,
    )
    form = f" ({args.quantization})" if args.quantization else ""
    what = "config and tokenizer" if args.config_only else "checkpoint"
    print(f"wrote {args.preset}{form}'s {what} to {path} in {time.perf_counter() - start:.1f} s")
    return 0
