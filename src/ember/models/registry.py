"""Maps a Hugging Face architecture name to the class that implements it, imported lazily."""

from __future__ import annotations

import importlib

from ember.config import LLAMA4_ARCHITECTURES, MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES

# Architectures implemented in a module of their own (the class named as the architecture).
_OWN_MODULES = {
    "GptOssForCausalLM": "ember.models.gpt_oss",
    **{arch: "ember.models.llama4" for arch in LLAMA4_ARCHITECTURES},
}


def _location(arch: str) -> tuple[str, str]:
    """Where the class of ``arch`` lives: a module of its own, else the Llama file (the dense
    family) or, for its mixture-of-experts members, `ember.models.llama_moe`."""
    if arch in _OWN_MODULES:
        return _OWN_MODULES[arch], arch
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
