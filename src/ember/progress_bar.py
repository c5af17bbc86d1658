"""The offline API's progress bar over prompts (vLLM's ``use_tqdm``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tqdm import tqdm

UseTqdm = bool | Callable[..., Any]


def prompt_progress(use_tqdm: UseTqdm, total: int) -> Any | None:
    """A bar counting finished prompts, on stderr: None for False, tqdm for True, or what the
    given tqdm-like factory builds (vLLM's ``use_tqdm`` takes one too)."""
    if use_tqdm is False or use_tqdm is None:
        return None
    factory = tqdm if use_tqdm is True else use_tqdm
    return factory(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True)
