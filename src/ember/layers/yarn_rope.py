"""YaRN RoPE frequencies (gpt-oss's "yarn" rope_type), with transformers' arithmetic.

Frequencies that turn fewer than ``beta_slow`` times over the original context are interpolated
(divided by ``factor``), those that turn more than ``beta_fast`` times are kept, and a linear ramp
over the dimensions between blends the two. The cos/sin table built from them is scaled by the
config's attention factor (`ember.config.YarnRopeScaling`), which scales every attention logit
by its square, as transformers' rotary embedding does.
"""

from __future__ import annotations

import math

import torch

from ember.config import YarnRopeScaling


def _correction_dim(rotations: float, dim: int, theta: float, context: int) -> float:
    """The (fractional) dimension whose frequency turns ``rotations`` times over ``context``."""
    return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(theta))


def _correction_range(dim: int, theta: float, scaling: YarnRopeScaling) -> tuple[float, float]:
    context = scaling.original_max_position_embeddings
    low = _correction_dim(scaling.beta_fast, dim, theta, context)
    high = _correction_dim(scaling.beta_slow, dim, theta, context)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(head_dim: int, theta: float, scaling: YarnRopeScaling) -> torch.Tensor:
    """float32 ``[head_dim // 2]``: each rotary pair's inverse frequency under YaRN."""
    exponents = torch.arange(0, head_dim, 2).to(torch.float32) / head_dim
    base_freqs = theta**exponents
    extrapolated = 1.0 / base_freqs
    interpolated = 1.0 / (scaling.factor * base_freqs)
    low, high = _correction_range(head_dim, theta, scaling)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of each frequency that stays unscaled
    return interpolated * (1 - keep) + extrapolated * keep
