"""When a small decode step pulls upcoming weights into L2, on a side stream.

The model calls this after launching a GEMM, naming the weight that a later GEMM reads; at most
``max_tokens`` query tokens, the prefetch is forked onto a side stream from that point of the
main stream, so it runs while the small kernels between the two GEMMs leave HBM idle. The main
stream never waits for a prefetch inside the pass: the side stream is joined back once, by
``join()`` at the end of the forward pass (CUDA graph capture requires it).

Modes: ``"attention"`` prefetches the whole o_proj weight across RoPE and attention (the longest
gap); ``"all"`` also the first ``gap_bytes`` of gate/up, down, the next layer's q/k/v and the LM
head across the norm and SiLU gaps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ember.config import L2_PREFETCH_MODES

# L2 of an H100/H200 is 50 MB; a weight larger than this is not prefetched whole.
_MAX_WHOLE_BYTES = 40 << 20


class WeightPrefetcher:
    def __init__(
        self,
        mode: str,
        max_tokens: int,
        gap_bytes: int = 8 << 20,
        launch: Callable[[torch.Tensor, int | None], None] | None = None,
    ) -> None:
        if mode not in L2_PREFETCH_MODES:
            raise ValueError(f"L2 prefetch mode must be one of {L2_PREFETCH_MODES}, not {mode!r}")
        if max_tokens < 0 or gap_bytes < 0:
            raise ValueError("L2 prefetch max_tokens and gap_bytes must be >= 0")
        self.mode = mode
        self.max_tokens = max_tokens
        self.gap_bytes = gap_bytes
        if launch is None:
            from ember.kernels.l2_prefetch import prefetch_to_l2 as launch
        self._launch = launch
        self._stream: torch.cuda.Stream | None = None
        self._pending = False

    def across_attention(self, weight: torch.Tensor, num_tokens: int) -> None:
        """After q/k/v: the o_proj weight, whole, while RoPE and attention run."""
        if self.mode != "off" and weight.numel() * weight.element_size() <= _MAX_WHOLE_BYTES:
            self._fork(weight, None, num_tokens)

    def across_gap(self, weight: torch.Tensor, num_tokens: int) -> None:
        """After a GEMM followed by a short kernel (norm, SiLU): the next weight's first part."""
        if self.mode == "all" and self.gap_bytes:
            self._fork(weight, self.gap_bytes, num_tokens)

    @property
    def forked(self) -> bool:
        """Whether any prefetch has gone to the side stream (the stream exists)."""
        return self._stream is not None

    def join(self) -> None:
        """Make the current stream wait for the last prefetch (end of a forward pass)."""
        if self._pending:
            torch.cuda.current_stream().wait_stream(self._stream)
            self._pending = False

    def _fork(self, weight: torch.Tensor, max_bytes: int | None, num_tokens: int) -> None:
        if num_tokens > self.max_tokens:
            return
        if not weight.is_cuda:  # the policy alone (CPU tests): no streams to fork
            self._launch(weight, max_bytes)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=weight.device)
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            self._launch(weight, max_bytes)
        self._pending = True
