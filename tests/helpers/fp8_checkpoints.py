"""FP8 checkpoints written from a tiny model's float weights, in the layouts users have.

- "compressed-tensors": llm-compressor's FP8_DYNAMIC, a bf16 ``weight_scale`` per output channel
  ``[out, 1]``, activations dynamic per token, the output head left out.
- "fp8": ``quant_method: fp8`` (AutoFP8), a float32 ``weight_scale`` per tensor (shape ``[]``)
  and a static ``input_scale`` beside each weight.

Either may carry KV-cache scales too. A mixture of experts' experts are quantized one by one
(``mlp.experts.{e}.gate_proj``, Mixtral's ``block_sparse_moe.experts.{e}.w1``, Llama 4's
``feed_forward.experts.{e}.gate_proj``, its stacked experts split first), its routers left in
float and named among the unquantized modules, as llm-compressor's MoE recipes and AutoFP8
write them; a multimodal checkpoint's vision tower and projector are left in float and named
too. `dequantized_checkpoint` writes the float32 weights an FP8 checkpoint stands for
(``weight * scale``; Llama 4's experts stacked back as transformers saves them), the reference
its logits must match.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ember.bench.make_model import COMPRESSED_TENSORS_FP8
from helpers import llama4_experts

WEIGHTS = "model.safetensors"
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# A static input scale: read and checked by ember, never used.
STATIC_INPUT_SCALE = 0.02

# What `ember bench make-model --quantization fp8` writes, as llm-compressor does.
COMPRESSED_TENSORS = COMPRESSED_TENSORS_FP8
PLAIN_FP8 = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}


# A linear layer's weight: a projection's, or an expert's (Mixtral's w1/w2/w3 included).
_LINEAR_WEIGHT = re.compile(r".*(_proj|\.experts\.\d+\.\w+)\.weight")
# A router: "model.layers.{i}.mlp.gate.weight", Mixtral's "...block_sparse_moe.gate.weight",
# Llama 4's "...feed_forward.router.weight" (a multimodal checkpoint's under "language_model.").
_ROUTER_WEIGHT = re.compile(r"(?:\w+\.)?(model\.layers\.\d+\.(\w+\.(?:gate|router)))\.weight")
# A multimodal checkpoint's vision tower and projector, which llm-compressor leaves in float.
_OUTSIDE_TEXT_MODEL = ("vision_model.", "multi_modal_projector.")
# An attention projection's weight in the text model (a multimodal one's under its prefix).
_ATTENTION_WEIGHT = re.compile(r"(?:\w+\.)?model\.layers\.\d+\.self_attn\.\w+_proj\.weight")


def _quantized(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (weight.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def fp8_checkpoint(
    source: Path,
    out: Path,
    layout: str,
    *,
    kv_scales: tuple[float, float] | None = None,
    float_attention: bool = False,
) -> Path:
    """``source`` (a tiny model directory) copied to ``out`` with its decoder's linear weights
    in FP8 in ``layout``; ``kv_scales`` (k, v): every layer holds them, as ``self_attn.k_scale``
    and ``v_scale``; ``float_attention``: the attention projections left in float and named
    unquantized, as llm-compressor's Llama 4 recipes leave them."""
    shutil.copytree(source, out)
    weights = llama4_experts.unstacked(load_file(str(source / WEIGHTS)))
    written: dict[str, torch.Tensor] = {}
    attention = [name for name in weights if _ATTENTION_WEIGHT.fullmatch(name)]
    for name, tensor in weights.items():
        unquantized = name.startswith(_OUTSIDE_TEXT_MODEL) or (
            float_attention and name in attention
        )
        if not _LINEAR_WEIGHT.fullmatch(name) or unquantized:
            written[name] = tensor
            continue
        stem = name.removesuffix("weight")
        if layout == "compressed-tensors":
            scale = (tensor.abs().amax(dim=1, keepdim=True) / FP8_MAX).to(torch.bfloat16)
        else:
            scale = tensor.abs().amax() / FP8_MAX
            written[stem + "input_scale"] = torch.tensor(STATIC_INPUT_SCALE)
        written[name] = _quantized(tensor, scale)
        written[stem + "weight_scale"] = scale
    if kv_scales is not None:
        layers = {name.split(".")[2] for name in weights if name.startswith("model.layers.")}
        for layer in layers:
            written[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(kv_scales[0])
            written[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(kv_scales[1])
    save_file(written, str(out / WEIGHTS), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    quantization = copy.deepcopy(
        COMPRESSED_TENSORS if layout == "compressed-tensors" else PLAIN_FP8
    )
    matches = [m for m in map(_ROUTER_WEIGHT.fullmatch, weights) if m is not None]
    routers = sorted({m[1] for m in matches})
    vision = any(name.startswith(_OUTSIDE_TEXT_MODEL) for name in weights)
    if layout == "compressed-tensors":  # llm-compressor: one pattern for all
        quantization["ignore"] += [f"re:.*{router}$" for router in sorted({m[2] for m in matches})]
        if vision:
            quantization["ignore"] += ["re:.*vision_model.*", "re:.*multi_modal_projector.*"]
        if float_attention:
            quantization["ignore"] += ["re:.*self_attn", "Llama4TextAttention"]
    else:  # AutoFP8: every module by name
        quantization["ignored_layers"] += routers
        if vision:
            quantization["ignored_layers"] += ["vision_model", "multi_modal_projector"]
        if float_attention:
            quantization["ignored_layers"] += [name.removesuffix(".weight") for name in attention]
    config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def dequantized_checkpoint(fp8_dir: Path, out: Path) -> Path:
    """``fp8_dir`` copied to ``out`` as a float32 checkpoint of the weights it stands for:
    each FP8 weight times its scale, no scales, no quantization_config."""
    shutil.copytree(fp8_dir, out)
    weights = load_file(str(fp8_dir / WEIGHTS))
    written = {}
    for name, tensor in weights.items():
        if name.endswith(("_scale", "input_scale")):
            continue
        if tensor.dtype == FP8:
            scale = weights[name.removesuffix("weight") + "weight_scale"].float()
            tensor = tensor.float() * (scale if scale.dim() == 2 else scale.reshape(1, 1))
        written[name] = tensor
    written = llama4_experts.stacked(written)
    save_file(written, str(out / WEIGHTS), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
