"""Qwen3's q/k norm as an attention option: each head of q and of k RMS-normalised with its own
learned weight, after the q/k/v projection and before RoPE.

A layer passes it to `AttentionBackend.forward(..., qk_norm=QkNorm(...))`, and the kernels that
rotate q and k apply it as they load them (`rope_and_cache_write`, a fused decode's attention
kernel): no RMSNorm launch of its own. Its rounding is `rms_norm`'s (docs/CONTRACTS.md,
"Windows, sinks, chunks").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QkNorm:
    """RMSNorm of each ``head_dim``-wide head of q (by ``q_weight``) and of k (by
    ``k_weight``), both ``[head_dim]``, with ``eps``, before the rotation."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float

    def check(self, head_dim: int) -> None:
        """Refuse weights that are not contiguous ``[head_dim]``."""
        for name, weight in (("q_weight", self.q_weight), ("k_weight", self.k_weight)):
            if tuple(weight.shape) != (head_dim,) or weight.stride(0) != 1:
                raise ValueError(
                    f"qk_norm's {name} must be contiguous [{head_dim}], got "
                    f"{tuple(weight.shape)} with strides {weight.stride()}"
                )


def check_qk_norms(qk_norm: QkNorm | None, qk_l2_norm_eps: float | None) -> None:
    """Refuse both q/k norms at once: no model has both, so no path orders them."""
    if qk_norm is not None and qk_l2_norm_eps is not None:
        raise ValueError(
            "qk_norm (an RMSNorm before RoPE, Qwen3's) and qk_l2_norm_eps (an L2 norm after it, "
            "Llama 4's) are not supported together"
        )
