"""Recovering Llama 3 RoPE scaling parameters from a GGUF's `rope_freqs` tensor.

llama.cpp has no metadata key for "llama3" scaling: its converter bakes the parameters into a
`rope_freqs` tensor of per-frequency divisors. HF configs (and ember's `RopeScaling`) want the
parameters, so we fit them back. The three of them (original context, low and high frequency
factors) only matter through their ratios, so we fix `low_freq_factor = 1` as Llama 3 does.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

_LOW_FREQ_FACTOR = 1.0
_MATCH_RTOL = 1e-4


def llama3_rope_scaling(
    divisors: np.ndarray, rope_theta: float, rotary_dim: int, path: str
) -> dict[str, Any] | None:
    """HF `rope_scaling` dict reproducing `divisors` (llama.cpp's rope_freqs), or None if all 1.

    Raises ValueError (naming `path`) when the divisors do not follow the llama3 formula.
    """
    divisors = np.asarray(divisors, dtype=np.float64)
    wavelengths = rope_wavelengths(rope_theta, rotary_dim)
    if divisors.shape != wavelengths.shape:
        raise ValueError(
            f"{path}: rope_freqs has {divisors.size} entries, expected {rotary_dim // 2}"
        )
    factor = float(divisors.max())
    if np.allclose(divisors, 1.0, rtol=_MATCH_RTOL):
        return None
    # In the medium band the divisor r satisfies 1/r = (1 - s)/factor + s, with the smoothing s
    # linear in 1/wavelength:
    # s = original_context / ((high - low) * wavelength) - low / (high - low).
    medium = (divisors > 1 + _MATCH_RTOL) & (divisors < factor * (1 - _MATCH_RTOL))
    if medium.sum() < 2:
        raise ValueError(f"{path}: cannot recover llama3 rope scaling from rope_freqs")
    smooth = (1 / divisors[medium] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(1 / wavelengths[medium], smooth, 1)
    high_freq_factor = _LOW_FREQ_FACTOR - _LOW_FREQ_FACTOR / intercept
    original_context = slope * (high_freq_factor - _LOW_FREQ_FACTOR)
    scaling = {
        "rope_type": "llama3",
        "factor": round(factor, 6),
        "low_freq_factor": _LOW_FREQ_FACTOR,
        "high_freq_factor": round(float(high_freq_factor), 4),
        "original_max_position_embeddings": round(float(original_context)),
    }
    if not np.allclose(llama3_divisors(scaling, wavelengths), divisors, rtol=_MATCH_RTOL):
        raise ValueError(f"{path}: rope_freqs does not follow llama3 rope scaling")
    return scaling


def llama3_divisors(scaling: dict[str, Any], wavelengths: np.ndarray) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores for `scaling` (its converter's formula)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    smooth = (original / wavelengths - low) / (high - low)
    divisors = 1 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelengths < original / high, 1.0, divisors)
    return np.where(wavelengths > original / low, factor, divisors)


def rope_wavelengths(rope_theta: float, rotary_dim: int) -> np.ndarray:
    """Wavelength (in positions) of each rotary frequency pair."""
    return 2 * math.pi * rope_theta ** (np.arange(0, rotary_dim, 2) / rotary_dim)
