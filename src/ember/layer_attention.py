"""How each decoder layer attends, read from a Hugging Face config: sliding windows (Mistral,
Qwen2/3, gpt-oss), chunked local attention and NoPE layers with QK norm and temperature tuning
(Llama 4), attention sinks (gpt-oss). docs/CONTRACTS.md, "Windows, sinks, chunks".

The rules follow transformers 5.x: a layer's kind comes from ``layer_types`` where the config has
one (and the architecture reads it), else from the architecture's own defaults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# Every layer windowed when ``sliding_window`` is set (the architecture ignores layer_types).
_WINDOW_EVERY_LAYER = ("MistralForCausalLM", "MixtralForCausalLM")
# Windowed only with ``use_sliding_window``; per layer from layer_types or max_window_layers.
_QWEN_WINDOWS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Windowed only with ``use_sliding_window``; by default every other layer below max_window_layers.
_QWEN2_MOE = ("Qwen2MoeForCausalLM",)
# Windowed only with ``use_sliding_window``, then every layer.
_QWEN_MOE_WINDOWS = ("Qwen3MoeForCausalLM",)
_LLAMA4 = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")
_GPT_OSS = ("GptOssForCausalLM",)


@dataclass(frozen=True)
class AttentionTemperature:
    """Llama 4's temperature tuning of its NoPE layers: the query at position p is scaled by
    ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``."""

    floor_scale: float
    attn_scale: float


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention. ``window``: a query at p sees keys ``p - window + 1 .. p``;
    ``chunk_size``: keys ``p // chunk_size * chunk_size .. p`` (at most one of the two).
    ``sinks``: a learned logit per query head joins its softmax denominator. ``use_rope`` False:
    q and k are not rotated. ``qk_l2_norm_eps``: q and k are normalised per head after RoPE (no
    weight). ``temperature``: queries scaled by position (NoPE layers only)."""

    window: int | None = None
    chunk_size: int | None = None
    sinks: bool = False
    use_rope: bool = True
    qk_l2_norm_eps: float | None = None
    temperature: AttentionTemperature | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.chunk_size is not None:
            raise ValueError("a layer attends over a sliding window or in chunks, not both")
        if min(self.window or 1, self.chunk_size or 1) < 1:
            raise ValueError(f"windows and chunks hold at least one key: {self}")
        if self.temperature is not None and self.use_rope:
            raise ValueError("attention temperature tuning applies to NoPE layers only")

    def within(self, max_model_len: int) -> LayerAttention:
        """This layer for sequences of at most ``max_model_len`` tokens (0: unknown): a window or
        chunk that long never hides a key, so it is dropped and costs nothing."""
        if not max_model_len:
            return self
        window = self.window if self.window is not None and self.window < max_model_len else None
        chunk = self.chunk_size
        chunk = chunk if chunk is not None and chunk < max_model_len else None
        return dataclasses.replace(self, window=window, chunk_size=chunk)

    @property
    def key_span(self) -> int | None:
        """The most keys a query sees (None: all before it)."""
        return self.window if self.window is not None else self.chunk_size


PLAIN = LayerAttention()


def layer_attention_from_hf(cfg: dict[str, Any], architecture: str) -> tuple[LayerAttention, ...]:
    """Each layer's `LayerAttention` from a Hugging Face (text) config: one per layer, or one
    for every layer where the config makes them alike (() where that one is plain attention), so
    a config's layer count is never walked unless its layers differ."""
    llama4 = architecture in _LLAMA4
    window = cfg.get("sliding_window", 128 if architecture in _GPT_OSS else None)
    qwen = _QWEN_WINDOWS + _QWEN2_MOE + _QWEN_MOE_WINDOWS
    if architecture in qwen and not cfg.get("use_sliding_window"):
        window = None  # transformers' Qwen configs drop the window without use_sliding_window
    uniform = _uniform_kind(cfg, architecture, window is not None)
    if uniform is not None:
        layer = LayerAttention(window=int(window) if uniform == "sliding_attention" else None)
        return () if layer == PLAIN else (layer,)
    num_layers = int(cfg["num_hidden_layers"])
    chunk = cfg.get("attention_chunk_size", 8192 if llama4 else None)
    rope = _rope_layers(cfg, architecture, num_layers)
    kinds = _layer_types(cfg, architecture, rope, window is not None, chunk is not None)
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    temperature = None
    if llama4 and cfg.get("attn_temperature_tuning", True):
        temperature = AttentionTemperature(
            float(cfg.get("floor_scale", 8192)), float(cfg.get("attn_scale", 0.1))
        )
    qk_l2_norm = llama4 and cfg.get("use_qk_norm", True)
    layers = tuple(
        LayerAttention(
            window=int(window) if kind == "sliding_attention" else None,
            chunk_size=int(chunk) if kind == "chunked_attention" else None,
            sinks=architecture in _GPT_OSS,
            use_rope=use_rope,
            # transformers builds Llama 4's QK norm on its RoPE layers only.
            qk_l2_norm_eps=eps if qk_l2_norm and use_rope else None,
            temperature=None if use_rope else temperature,
        )
        for kind, use_rope in zip(kinds, rope)
    )
    return () if all(layer == PLAIN for layer in layers) else layers


def _uniform_kind(cfg: dict[str, Any], architecture: str, windowed: bool) -> str | None:
    """The one kind of every layer where the architecture and config make them alike, else
    None."""
    if architecture in _WINDOW_EVERY_LAYER + _QWEN_MOE_WINDOWS:
        return "sliding_attention" if windowed else "full_attention"
    if architecture in _QWEN_WINDOWS + _QWEN2_MOE:
        return None if windowed else "full_attention"
    if architecture in _LLAMA4 + _GPT_OSS or cfg.get("layer_types") is not None:
        return None
    return "full_attention"


def _layer_types(
    cfg: dict[str, Any], architecture: str, rope: list[bool], windowed: bool, chunked: bool
) -> list[str]:
    """Each layer's transformers ``layer_types`` entry as the architecture resolves it:
    "full_attention", "sliding_attention" (only where the config has a window) or
    "chunked_attention"."""
    num_layers = len(rope)
    if cfg.get("layer_types") is not None:
        kinds = list(cfg["layer_types"])
    elif architecture in _QWEN_WINDOWS:
        first = int(cfg.get("max_window_layers", num_layers))
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    elif architecture in _QWEN2_MOE:
        first = int(cfg.get("max_window_layers", num_layers))
        kinds = [
            "sliding_attention" if i % 2 == 0 and i < first else "full_attention"
            for i in range(num_layers)
        ]
    elif architecture in _LLAMA4:
        kinds = ["chunked_attention" if chunked and r else "full_attention" for r in rope]
    elif architecture in _GPT_OSS:  # alternating, sliding first
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    else:
        kinds = ["full_attention"] * num_layers
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types names {len(kinds)} layers, the model has {num_layers}")
    unknown = set(kinds) - {"full_attention", "sliding_attention", "chunked_attention"}
    if unknown:
        raise ValueError(f"unsupported attention layer types {sorted(unknown)}")
    if "chunked_attention" in kinds and not chunked:
        raise ValueError("chunked attention layers without an attention_chunk_size")
    # Without a window, transformers' sliding layers attend to everything (Qwen without
    # use_sliding_window).
    return [k if windowed or k != "sliding_attention" else "full_attention" for k in kinds]


def _rope_layers(cfg: dict[str, Any], architecture: str, num_layers: int) -> list[bool]:
    """Whether each layer rotates q and k: Llama 4's ``no_rope_layers`` (1: RoPE, 0: NoPE;
    by default every ``no_rope_layer_interval``-th layer is NoPE), else all."""
    if architecture not in _LLAMA4:
        return [True] * num_layers
    flags = cfg.get("no_rope_layers")
    if not flags:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        flags = [(i + 1) % interval != 0 for i in range(num_layers)]
    if len(flags) != num_layers:
        raise ValueError(f"no_rope_layers names {len(flags)} layers, the model has {num_layers}")
    return [bool(flag) for flag in flags]
