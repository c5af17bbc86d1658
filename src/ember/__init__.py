"""ember: an LLM inference server for GPUs at the edge."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]

if TYPE_CHECKING:
    from ember.api import LLM, CompletionOutput, Engine, RequestOutput
    from ember.inputs import TextPrompt, TokensPrompt
    from ember.sampling_params import SamplingParams
    from ember.structured_output.params import StructuredOutputsParams


def __getattr__(name: str):
    # Imported on first use so that `ember --help` and the front end don't pay for torch.
    if name in ("LLM", "Engine", "RequestOutput", "CompletionOutput"):
        from ember import api

        return getattr(api, name)
    if name in ("TextPrompt", "TokensPrompt"):
        from ember import inputs

        return getattr(inputs, name)
    if name == "SamplingParams":
        from ember.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from ember.structured_output.params import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'ember' has no attribute {name!r}")
