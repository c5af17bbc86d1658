"""Maps a Hugging Face architecture name to the class that implements it, imported lazily."""

from __future__ import annotations

import importlib

from ember.config import MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES

# Architectures implemented in a module of their own (the class named as the architecture).
_OWN_MODULES = {"GptOssForCausalLM": "ember.models.gpt_oss"}

# HF architecture name -> (module, class). The Llama file covers the dense family; its
# mixture-of-experts members have a class each.
_MODELS = {
    arch: (_OWN_MODULES[arch], arch)
    if arch in _OWN_MODULES
    else ("ember.models.llama_moe", arch)
    if arch in MOE_ARCHITECTURES
    else ("ember.models.llama", "LlamaForCausalLM")
    for arch in SUPPORTED_ARCHITECTURES
}


def model_class(architecture: str) -> type:
    try:
        module_name, class_name = _MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; ember supports: "
            + ", ".join(sorted(_MODELS))
        ) from None
    return getattr(importlib.import_module(module_name), class_name)
