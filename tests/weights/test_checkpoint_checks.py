"""A bad checkpoint fails at load with the file and the tensor named, instead of misbehaving.

A config that disagrees with its tensors (one left over, one of another shape, far more layers
than the file holds) fails while the model is planned, and a tensor missing from a layer the
file holds fails as the model loads: both from the headers alone, before anything is allocated.
Damaged tensor data (a NaN or an infinity in a safetensors tensor, garbage in a GGUF's tensor
region) fails once the weights have landed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import TINY_ARCHITECTURES, make_tiny_model, smollm2_gguf_path, tiny_config
from safetensors.torch import load_file, save_file

from ember import LLM
from ember.config import ModelConfig
from ember.engine.model_instance import ModelInstance
from ember.models.checkpoint_layout import CheckpointLayout
from ember.models.llama import LlamaForCausalLM
from ember.models.registry import model_class
from ember.quantization import Fp8Scheme
from ember.weights.finite_check import first_non_finite
from ember.weights.gguf_file import GGUFFile

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture
def model_dir(tiny_model, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_model, tmp_path / "m"))


@pytest.fixture
def no_allocation(monkeypatch):
    """Fails the test if a model's parameters are allocated: the check must come first."""

    def allocate(self, zeroed):
        raise AssertionError("the model was allocated before its checkpoint was checked")

    monkeypatch.setattr(ModelInstance, "_allocate_model", allocate)


def edit_config(path: Path, **fields) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


def edit_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    weights = load_file(path / WEIGHTS)
    edit(weights)
    save_file(weights, str(path / WEIGHTS), metadata={"format": "pt"})
    return path / WEIGHTS


def load(path: Path) -> LLM:
    return LLM(str(path), device="cpu", max_model_len=64)


def names(path: Path, tensor: str) -> str:
    """A pattern for an error that names ``path`` and then ``tensor``."""
    return re.escape(str(path)) + r": (no )?tensor " + re.escape(repr(tensor))


# --- a config that disagrees with its tensors: refused before anything is allocated ---------------


def test_a_missing_tensor_is_named_with_its_file(model_dir, no_allocation):
    tensor = "model.layers.1.mlp.down_proj.weight"
    file = edit_weights(model_dir, lambda weights: weights.pop(tensor))
    with pytest.raises(ValueError, match=names(file, tensor) + ", which LlamaForCausalLM reads"):
        load(model_dir)


def test_an_extra_tensor_is_named_with_its_file(model_dir, no_allocation):
    tensor = "model.layers.0.mlp.extra_proj.weight"
    file = edit_weights(model_dir, lambda weights: weights.update({tensor: torch.zeros(4, 4)}))
    with pytest.raises(ValueError, match=names(file, tensor) + " is not a tensor that"):
        load(model_dir)


def test_layers_beyond_the_configs_count_are_extra(model_dir, no_allocation):
    edit_config(model_dir, num_hidden_layers=1)
    match = names(model_dir / WEIGHTS, "model.layers.1.input_layernorm.weight")
    with pytest.raises(ValueError, match=match + " belongs to layer 1.*num_hidden_layers=1"):
        load(model_dir)


def test_a_tensor_of_the_wrong_shape_is_named_with_its_file(model_dir, no_allocation):
    tensor = "model.layers.1.self_attn.k_proj.weight"  # [kv_heads * head_dim, hidden] = [32, 64]
    file = edit_weights(model_dir, lambda weights: weights.update({tensor: torch.zeros(16, 64)}))
    with pytest.raises(
        ValueError, match=names(file, tensor) + r" has shape \(16, 64\).*\(32, 64\)"
    ):
        load(model_dir)


def test_a_config_dimension_that_disagrees_with_the_tensors(model_dir, no_allocation):
    edit_config(model_dir, intermediate_size=96)
    tensor = r"'model\.layers\.\d+\.mlp\.\w+\.weight' has shape"
    match = re.escape(f"{model_dir / WEIGHTS}: tensor ") + tensor + r".*\((96, 64|64, 96)\)"
    with pytest.raises(ValueError, match=match):
        load(model_dir)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    return make_tiny_model("MixtralForCausalLM", tmp_path_factory.mktemp("tiny-moe") / "m")


def test_a_missing_expert_is_named_with_its_file(tiny_moe, tmp_path, no_allocation):
    model_dir = Path(shutil.copytree(tiny_moe, tmp_path / "m"))
    tensor = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    file = edit_weights(model_dir, lambda weights: weights.pop(tensor))
    with pytest.raises(ValueError, match=names(file, tensor) + ", which MixtralForCausalLM reads"):
        load(model_dir)


def test_experts_beyond_the_configs_count_are_extra(tiny_moe, tmp_path, no_allocation):
    model_dir = Path(shutil.copytree(tiny_moe, tmp_path / "m"))
    edit_config(model_dir, num_local_experts=6)
    tensor = r"'model\.layers\.\d\.block_sparse_moe\.(gate\.weight|experts\.[67]\.w\d\.weight)'"
    with pytest.raises(ValueError, match=tensor + r" (is not a tensor that|has shape)"):
        load(model_dir)


@pytest.fixture(scope="module")
def tiny_llama4_multimodal(tmp_path_factory) -> Path:
    """A Llama4ForConditionalGeneration: its text model under ``language_model.``."""
    path = tmp_path_factory.mktemp("tiny-llama4") / "m"
    return make_tiny_model("Llama4ForConditionalGeneration", path)


def test_a_multimodal_checkpoints_text_tensors_are_named_as_stored(
    tiny_llama4_multimodal, tmp_path, no_allocation
):
    model_dir = Path(shutil.copytree(tiny_llama4_multimodal, tmp_path / "m"))
    tensor = "language_model.model.layers.1.feed_forward.experts.down_proj"
    file = edit_weights(model_dir, lambda weights: weights.pop(tensor))
    reads = ", which Llama4ForConditionalGeneration reads"
    with pytest.raises(ValueError, match=names(file, tensor) + reads):
        load(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    text = config["text_config"]
    for per_layer in ("no_rope_layers", "layer_types", "moe_layers"):  # as written for 4 layers
        text.pop(per_layer)
    text["num_hidden_layers"] = 6
    (model_dir / "config.json").write_text(json.dumps(config))
    match = names(file, "language_model.model.layers.4.input_layernorm.weight")
    with pytest.raises(ValueError, match=match + r".*num_hidden_layers=6.*of 4 layers"):
        load(model_dir)


@pytest.mark.timeout(20, func_only=True)
def test_a_config_claiming_far_more_layers_fails_at_once(model_dir, no_allocation):
    """Everything a load builds is sized from the config: checked first, a billion layers cost
    what the two in the file cost, instead of a model built and allocated layer by layer."""
    edit_config(model_dir, num_hidden_layers=10**9)
    match = names(model_dir / WEIGHTS, "model.layers.2.input_layernorm.weight")
    with pytest.raises(ValueError, match=match + r".*num_hidden_layers=1000000000.*of 2 layers"):
        load(model_dir)


def test_tensors_the_model_ignores_are_neither_missing_nor_extra(model_dir):
    """A tied model may store its head anyway (this one holds the head it was saved with), and
    some checkpoints store RoPE's inv_freq."""
    inv_freq = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    edit_weights(model_dir, lambda weights: weights.update(inv_freq))
    edit_config(model_dir, tie_word_embeddings=True)
    assert load(model_dir).instance.model.cfg.tie_word_embeddings


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
@pytest.mark.parametrize("tie", [False, True])
def test_the_layout_is_what_the_loader_places(arch, tie):
    """Every tensor the layout names has a place of its shape in the model, and together they
    fill every parameter: the planning check and the loader agree."""
    check_layout_fills_the_model(tiny_config(arch, tie=tie).to_dict())


@pytest.mark.parametrize(
    ("arch", "fields"),
    [("Qwen3MoeForCausalLM", {"mlp_only_layers": [1]}), ("MixtralForCausalLM", {})],
)
@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
def test_the_experts_layout_in_either_form_is_what_the_loader_places(arch, fields, stacked):
    """Experts stored one tensor each or stacked per layer fill the same parameters (a
    Qwen3-MoE layer in mlp_only_layers reads a dense MLP instead)."""
    stored = ["model.layers.0.mlp.experts.gate_up_proj"] if stacked else []
    layout = check_layout_fills_the_model(tiny_config(arch, **fields).to_dict(), stored)
    names = set(layout.names())
    assert ("model.layers.0.mlp.experts.down_proj" in names) == stacked
    if arch == "Qwen3MoeForCausalLM":
        assert "model.layers.1.mlp.down_proj.weight" in names
        assert not any(name.startswith("model.layers.1.mlp.experts") for name in names)


def check_layout_fills_the_model(hf_config: dict, stored_names=()) -> CheckpointLayout:
    cfg = ModelConfig.from_hf_dict(hf_config)
    cls = model_class(cfg.architecture)
    layout = cls.checkpoint_layout(cfg, stored_names)
    placer = cls(cfg, _PlainNormOps(), None).weight_placer()
    for name in layout.names():
        placer.target(name, layout.shape_of(name)).zero_()
    placer.finish()  # raises if a parameter was left unfilled
    return layout


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
@pytest.mark.parametrize("weight_scales", ["tensor", "channel"])
def test_an_fp8_layout_is_what_the_loader_places(arch, weight_scales):
    """An FP8 checkpoint's layout: every projection's weight (float8) and scale have a place,
    and the optional input and KV-cache scales are taken too."""
    plain = ModelConfig.from_hf_dict(tiny_config(arch).to_dict())
    cfg = dataclasses.replace(plain, fp8=Fp8Scheme(True, weight_scales))
    layout = LlamaForCausalLM.checkpoint_layout(cfg)
    model = LlamaForCausalLM(cfg, _PlainNormOps(), None)
    placer = model.weight_placer()
    optional = [f"model.layers.1.{suffix}" for suffix in layout.optional_per_layer]
    for name in [*layout.names(), *optional]:
        shape = layout.shared.get(name)
        if shape is None:
            suffix = name.split(".", 3)[3]
            shape = layout.per_layer.get(suffix) or layout.optional_per_layer[suffix]
        if isinstance(shape, frozenset):  # a scale: [1] per tensor, [out, 1] per channel
            shape = max(shape)
        dtype = torch.float8_e4m3fn if name.endswith("_proj.weight") else torch.float32
        placer.target(name, shape, dtype).copy_(torch.full(shape, 0.5))
    placer.finish()
    attention = model.layers[1].self_attn
    assert attention.k_scale == attention.v_scale == 0.5
    assert torch.equal(
        attention.qkv_proj.weight_scale, torch.full((cfg.q_size + 2 * cfg.kv_size,), 0.5)
    )


class _PlainNormOps:
    defer_norms = False


# --- damaged tensor data: refused once loaded -----------------------------------------------------


@pytest.mark.parametrize(
    ("tensor", "value"),
    [
        ("model.layers.1.self_attn.v_proj.weight", math.nan),
        ("model.layers.0.post_attention_layernorm.weight", math.inf),  # before norm folding
        ("model.embed_tokens.weight", -math.inf),
    ],
)
def test_a_non_finite_value_in_a_safetensors_tensor_is_named(model_dir, tensor, value):
    def damage(weights):
        weights[tensor].view(-1)[7] = value

    file = edit_weights(model_dir, damage)
    with pytest.raises(ValueError, match=names(file, tensor) + " holds NaN or infinite values"):
        load(model_dir)


def test_values_that_overflow_the_dtype_are_refused_too(model_dir):
    tensor = "model.layers.0.mlp.up_proj.weight"

    def enlarge(weights):
        weights[tensor].view(-1)[3] = 1e6  # finite in float32, infinite in float16

    file = edit_weights(model_dir, enlarge)
    assert load(model_dir).instance.dtype == torch.float32
    with pytest.raises(ValueError, match=names(file, tensor) + r".*\(as float16\)"):
        LLM(str(model_dir), device="cpu", max_model_len=64, dtype="float16")


def test_first_non_finite_names_the_first_bad_tensor():
    good = torch.randn(64, 3, dtype=torch.bfloat16)
    nan, inf = good.clone(), good.clone()
    nan[5, 1], inf[0, 0] = math.nan, -math.inf
    empty = torch.empty(0, 3)
    assert first_non_finite([("a", good), ("e", empty)]) is None
    assert first_non_finite([]) is None
    assert first_non_finite([("a", good), ("b", inf), ("c", nan)]) == "b"
    assert first_non_finite([("e", empty), ("c", nan[5:])]) == "c"


# --- the real SmolLM2 GGUF ----------------------------------------------------------------------


@pytest.fixture
def gguf_copy(tmp_path) -> Path:
    return Path(shutil.copy(smollm2_gguf_path(), tmp_path / "smollm2.gguf"))


def set_metadata_u32(path: Path, key: str, value: int) -> None:
    """Rewrite one UINT32 metadata value in place (its bytes follow the key and its type)."""
    encoded = key.encode()
    data = bytearray(path.read_bytes())
    prefix = struct.pack("<Q", len(encoded)) + encoded + struct.pack("<I", 4)  # 4: UINT32
    assert data.count(prefix) == 1, key
    at = data.index(prefix) + len(prefix)
    data[at : at + 4] = struct.pack("<I", value)
    path.write_bytes(data)


@pytest.mark.slow
def test_garbage_in_a_gguf_tensor_is_named(gguf_copy):
    with GGUFFile(gguf_copy) as gguf:
        info = gguf.tensors["blk.3.ffn_down.weight"]
    with open(gguf_copy, "r+b") as file:
        file.seek(info.offset + 1000)
        file.write(b"\xff" * 64)  # a Q4_1 block's scale and minimum become NaN
    match = re.escape(f"{gguf_copy}: tensor 'model.layers.3.mlp.down_proj.weight' ") + re.escape(
        "(blk.3.ffn_down.weight in the file) holds NaN or infinite values"
    )
    with pytest.raises(ValueError, match=match):
        load(gguf_copy)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("llama.block_count", 31, "no tensor 'model.layers.30.input_layernorm.weight'"),
        ("llama.block_count", 29, r"tensor 'model.layers.29.\S+' \(blk.29.\S+ in the file\) belo"),
        ("llama.feed_forward_length", 1024, r"tensor 'model.layers.0.mlp.\S+' .* has shape"),
    ],
)
def test_gguf_metadata_that_disagrees_with_its_tensors(
    gguf_copy, no_allocation, key, value, message
):
    set_metadata_u32(gguf_copy, key, value)
    with pytest.raises(ValueError, match=re.escape(f"{gguf_copy}: ") + message):
        load(gguf_copy)
