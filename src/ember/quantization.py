"""Which FP8 form a model's linear layers take, read from its checkpoint's ``quantization_config``
or asked for at load (``--quantization fp8``). Importable without torch (the front end reads
configs too).

Two checkpoint layouts hold FP8 weights (``float8_e4m3fn``, ``[out, in]``) beside float scales
(float32, bfloat16 or float16):

- compressed-tensors ("FP8", "FP8_DYNAMIC" from llm-compressor): ``quant_method:
  compressed-tensors``, one config group of 8-bit float weights for every Linear layer but the
  output head, ``strategy`` "tensor" (a ``weight_scale`` of shape ``[1]``) or "channel"
  (``[out, 1]``); input activations dynamic per token, static per tensor (``input_scale``), or
  absent; ``kv_cache_scheme`` 8-bit float when the layers also hold ``self_attn.k_scale`` /
  ``v_scale`` (or, from older versions, ``k_proj.output_scale`` / ``v_proj.output_scale``).
- ``quant_method: fp8`` (AutoFP8, vLLM's own): per-tensor ``weight_scale`` (shape ``[]`` or
  ``[1]``), and ``input_scale`` when ``activation_scheme`` is "static". Block-wise scales
  (``weight_block_size``, ``weight_scale_inv``) are refused with a clear error.

Whatever the checkpoint says of activations, ember quantizes them per token and dynamically where
it multiplies in FP8 (at least as accurate as one static scale); a static ``input_scale`` is read
and checked, not used. ``--quantization fp8`` on a checkpoint of float weights (safetensors or
GGUF) quantizes each linear layer's weight as it loads, with a scale per output channel.

``quant_method: mxfp4`` (gpt-oss as OpenAI publishes it) holds only the experts in MXFP4
(``*_blocks`` / ``*_scales``), which the model keeps packed (`mxfp4_experts`,
`ember.layers.mxfp4`): for the linear layers it is a checkpoint of float weights.

In a mixture of experts, every expert's projections are FP8 too (one scale per expert and
output channel, or per expert tensor); the routers stay in the model's dtype, and a checkpoint
names them among its unquantized modules. A checkpoint may leave the attention projections
unquantized too (llm-compressor's Llama 4 recipes ignore ``re:.*self_attn`` and
``Llama4TextAttention``): every layer's attention then keeps the model's dtype
(`Fp8Scheme.float_attention`). A multimodal checkpoint's vision tower and projector, which
ember never reads, may be in any form.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ember.config import QUANTIZATION_CHOICES

# The last name of the output head, which a checkpoint may leave unquantized: ember keeps it in
# the model's dtype anyway (the embeddings are no Linear layer). As "lm_head", "re:.*lm_head",
# or a multimodal model's "language_model.lm_head".
_OUTPUT_HEAD = "lm_head"
# The last name of a mixture of experts' router, which ember keeps in the model's dtype too (its
# logits decide the experts: llm-compressor's recipes leave it out, as "re:.*mlp.gate$",
# "re:.*block_sparse_moe.gate", "re:.*router" or each layer's "model.layers.0.mlp.gate").
_ROUTER_NAMES = frozenset({"gate", "router"})
# Parts of a multimodal checkpoint outside the text model ember reads (Llama 4's vision tower
# and its projector, "re:.*vision_model.*", "multi_modal_projector.linear_1"): never loaded,
# whatever their form.
_OUTSIDE_TEXT_MODEL = ("vision", "multi_modal_projector")
# How a checkpoint names the attention it leaves unquantized: its modules' name, or the suffix
# of their class's.
_ATTENTION_MODULE = "self_attn"
_ATTENTION_CLASS_SUFFIX = "Attention"
# How an MXFP4 checkpoint names its experts' packed values (their scales: ``*_scales``).
MXFP4_BLOCKS_SUFFIX = "_proj_blocks"


@dataclass(frozen=True)
class Fp8Scheme:
    """FP8 weights for the decoder's linear layers (the embeddings and the output head stay in
    the model's dtype). ``from_checkpoint``: the file holds FP8 weights and their scales
    (``weight_scales`` "tensor" or "channel"; ``input_scales``: it holds static activation
    scales too; ``kv_scales``: each attention layer's ``k_scale`` / ``v_scale``); else the
    checkpoint's float weights are quantized as they load, with a scale per output channel.
    ``float_attention``: the checkpoint leaves every attention projection unquantized, so they
    keep the model's dtype (the other projections FP8)."""

    from_checkpoint: bool
    weight_scales: str = "channel"
    input_scales: bool = False
    kv_scales: bool = False
    float_attention: bool = False


def fp8_scheme(hf_config: dict[str, Any], requested: str | None = None) -> Fp8Scheme | None:
    """The FP8 form of a model whose config.json is ``hf_config``, loaded with ``--quantization
    requested`` (None: as the checkpoint is; "fp8" on an FP8 checkpoint loads it as it is).
    None: no FP8 at all. ValueError for a quantization ember cannot load."""
    if requested is not None and requested not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"unknown quantization {requested!r}; choose one of {', '.join(QUANTIZATION_CHOICES)}"
        )
    config = hf_config.get("quantization_config") or hf_config.get("compression_config")
    if not config:
        return Fp8Scheme(from_checkpoint=False) if requested == "fp8" else None
    method = _as_object(config).get("quant_method")
    if method == "mxfp4":  # only the experts (`mxfp4_experts`)
        return Fp8Scheme(from_checkpoint=False) if requested == "fp8" else None
    if method == "fp8":
        return _plain_fp8(config)
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    raise ValueError(
        f"config.json: quant_method {method!r} is not supported; ember loads FP8 checkpoints "
        "(quant_method fp8, or compressed-tensors FP8), gpt-oss's MXFP4 experts (quant_method "
        "mxfp4) and bf16/fp16/fp32 ones"
    )


def mxfp4_experts(hf_config: dict[str, Any], stored_names: Collection[str] | None) -> bool:
    """Whether a model holds its experts packed in MXFP4: its checkpoint stores them so (its
    tensor names ``stored_names`` hold ``*_proj_blocks``), or, for dummy weights (``stored_names``
    None), its config.json's ``quant_method`` is mxfp4."""
    if stored_names is not None:
        return any(name.endswith(MXFP4_BLOCKS_SUFFIX) for name in stored_names)
    config = hf_config.get("quantization_config") or {}
    return _as_object(config).get("quant_method") == "mxfp4"


def _plain_fp8(config: dict[str, Any]) -> Fp8Scheme:
    if config.get("weight_block_size"):
        raise ValueError(
            "config.json: block-wise FP8 scales (weight_block_size) are not supported; "
            "ember loads per-tensor and per-channel FP8 checkpoints"
        )
    if config.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"config.json: FP8 format {config['fmt']!r} is not supported (e4m3 is)")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"config.json: unknown FP8 activation_scheme {scheme!r}")
    float_attention = _check_unquantized(
        config.get("ignored_layers") or config.get("modules_to_not_convert")
    )
    return Fp8Scheme(
        from_checkpoint=True,
        weight_scales="tensor",
        input_scales=scheme == "static",
        float_attention=float_attention,
    )


def _compressed_tensors(config: dict[str, Any]) -> Fp8Scheme:
    form = config.get("format")
    if form not in ("float-quantized", "naive-quantized", None):
        raise ValueError(
            f"config.json: compressed-tensors format {form!r} is not supported; ember loads "
            "float-quantized (FP8) checkpoints"
        )
    groups = list((config.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(
            f"config.json: {len(groups)} compressed-tensors config groups; ember loads "
            "checkpoints with one (every Linear layer in FP8)"
        )
    group = groups[0]
    targets = group.get("targets") or ["Linear"]
    if "Linear" not in targets:
        raise ValueError(
            f"config.json: compressed-tensors targets {targets!r}; ember loads checkpoints whose "
            "one group targets every Linear layer"
        )
    float_attention = _check_unquantized(config.get("ignore"))
    weights = group.get("weights") or {}
    if not _is_fp8(weights):
        raise ValueError(
            f"config.json: compressed-tensors weights {weights!r} are not 8-bit float; ember "
            "loads FP8 weights"
        )
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel"):
        raise ValueError(
            f"config.json: FP8 weight strategy {strategy!r} is not supported; ember loads "
            "'tensor' and 'channel' scales"
        )
    if weights.get("dynamic"):
        raise ValueError("config.json: FP8 weights with dynamic scales hold no scales to load")
    activations = group.get("input_activations")
    if activations and not _is_fp8(activations):
        raise ValueError(f"config.json: input activations {activations!r} are not 8-bit float")
    kv = config.get("kv_cache_scheme")
    if kv and not _is_fp8(kv):
        raise ValueError(f"config.json: kv_cache_scheme {kv!r} is not 8-bit float")
    return Fp8Scheme(
        from_checkpoint=True,
        weight_scales=strategy,
        input_scales=bool(activations) and not activations.get("dynamic", False),
        kv_scales=bool(kv),
        float_attention=float_attention,
    )


def _check_unquantized(modules: list[str] | None) -> bool:
    """Whether the modules a checkpoint leaves in float include the attention projections;
    ValueError unless they are at most those, the output head, the experts' routers and what
    lies outside the text model: ember reads every other linear layer in FP8."""
    inside = [name for name in modules or () if not _is_outside_text_model(name)]
    attention = [name for name in inside if _names_attention(name)]
    others = [
        name
        for name in inside
        if _last_name(name) != _OUTPUT_HEAD
        and _last_name(name) not in _ROUTER_NAMES
        and name not in attention
    ]
    if others:
        raise ValueError(
            f"config.json: the checkpoint leaves {others[:3]} unquantized; ember loads FP8 "
            "checkpoints whose every linear layer but lm_head (and the experts' routers, or "
            "every attention projection) is FP8"
        )
    return bool(attention)


def _last_name(module: str) -> str:
    """The last name ``module`` (a name, or a compressed-tensors ``re:`` pattern) ends in: ""
    for a pattern that ends in a wildcard."""
    pattern = module.removeprefix("re:").rstrip("$")
    return re.split(r"[.*\]]", pattern)[-1]


def _is_outside_text_model(module: str) -> bool:
    """Whether ``module`` (a name, a pattern or a class name) lies outside the text model."""
    return any(part in module.lower() for part in _OUTSIDE_TEXT_MODEL)


def _names_attention(module: str) -> bool:
    """Whether ``module`` names attention modules: by name ("re:.*self_attn",
    "model.layers.0.self_attn.q_proj") or by class (transformers' "Llama4TextAttention")."""
    return _ATTENTION_MODULE in module or module.endswith(_ATTENTION_CLASS_SUFFIX)


def _as_object(config: Any) -> dict[str, Any]:
    if isinstance(config, dict):
        return config
    raise ValueError("config.json: quantization_config must be an object")


def _is_fp8(args: dict[str, Any]) -> bool:
    return args.get("num_bits") == 8 and args.get("type") == "float"
