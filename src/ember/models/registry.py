"""Maps a Hugging Face architecture name to the class that implements it, imported lazily."""

from __future__ import annotations

import importlib

from ember.config import LLAMA4_ARCHITECTURES, MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES


def _location(arch: str) -> tuple[str, str]:
    """Where the class of ``arch`` lives: Llama 4 in its own module; the Llama file covers the
    dense family, and its mixture-of-experts members have a class each."""
    if arch in LLAMA4_ARCHITECTURES:
        return "ember.models.llama4", arch
    if arch in MOE_ARCHITECTURES:
        return "ember.models.llama_moe", arch
    return "ember.models.llama", "LlamaForCausalLM"


# HF architecture name -> (module, class).
_MODELS = {arch: _location(arch) for arch in SUPPORTED_ARCHITECTURES}


def model_class(architecture: str) -> type:
    try:
        module_name, class_name = _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; ember supports: "
            + ", ".join(sorted(_MODELS))
        ) from None
    return getattr(importlib.import_module(module_name), class_name)
