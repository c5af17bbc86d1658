"""The allowed tokens of one step's grammar rows: filled on the CPU, applied on the device.

The runner fills them after it has enqueued the forward pass, so the matchers' work overlaps
the GPU's; they go up from a pinned buffer without a sync and are applied to the processed
logits just before the draw (the logprobs stay the model's own). One bit per token, as
llguidance writes them: bit ``t % 32`` of word ``t // 32`` is set when token ``t`` is allowed.
Every sampling row gets a mask (all ones without a grammar), so applying them is one masked
fill over the logits, with no gather or scatter of rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from ember.host_cpus import usable_cpus
from ember.structured_output.matcher import GrammarMatcher

BITS_PER_WORD = 32
# Threads computing masks: the engine loop waits for them, but half the host is left to the
# front end and the node's other services.
MAX_MASK_THREADS = 8


def allowed_tokens(bitmask: torch.Tensor, vocab: int, shifts: torch.Tensor) -> torch.Tensor:
    """bool ``[rows, vocab]``: which tokens ``bitmask`` (int32 ``[rows, words]``) allows.
    ``shifts``: ``arange(32)`` as int32 on the bitmask's device. On a CPU numpy unpacks the
    bits (its bytes are little-endian, as llguidance writes the words): torch's elementwise
    ops take a hundred times longer there."""
    if bitmask.device.type == "cpu":
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)[:, :vocab]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # an arithmetic shift: bit 31 reads right too
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


@dataclass(frozen=True)
class TokenMask:
    """A step's masks on the device, one per sampling row (all ones for a row without a
    grammar)."""

    bitmask: torch.Tensor
    shifts: torch.Tensor

    def apply(self, logits: torch.Tensor) -> None:
        """Set every token a row's grammar does not allow to -inf, in place."""
        allowed = allowed_tokens(self.bitmask, logits.shape[1], self.shifts)
        logits.masked_fill_(~allowed, float("-inf"))


class GrammarMasks:
    """One runner's mask buffers (a pinned host set the matchers write, a device copy) and the
    threads that fill them; built with the runner's first structured request."""

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device) -> None:
        words = -(-vocab_size // BITS_PER_WORD)
        self.device = device
        # Pinned: a copy from pageable memory would wait for the GPU. One host set is enough: a
        # step with grammar rows fills it only after the step in flight is collected, and that
        # step's copy was ordered before its done event.
        pin = device.type == "cuda"
        self._host = torch.zeros((max_rows, words), dtype=torch.int32, pin_memory=pin)
        self._device = torch.empty((max_rows, words), dtype=torch.int32, device=device)
        self._shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=device)
        threads = max(1, min(MAX_MASK_THREADS, usable_cpus() // 2))
        self._executor = llguidance.LLExecutor(num_threads=threads)

    def fill(self, grammars: list[GrammarMatcher], rows: list[int], num_rows: int) -> TokenMask:
        """The masks of a step's ``num_rows`` sampling rows, ``grammars[i]`` giving row
        ``rows[i]``'s (its next token) and every other row allowing everything: computed on
        the host, then copied to the device without waiting for it."""
        host = self._host[:num_rows]
        if len(rows) < num_rows:
            host.numpy().fill(-1)
        targets = [(grammar.matcher, row) for grammar, row in zip(grammars, rows)]
        row_bytes = host.stride(0) * host.element_size()
        self._executor.unsafe_compute_mask_ptr(targets, host.data_ptr(), row_bytes, num_rows)
        if self.device.type == "cpu":
            return TokenMask(host, self._shifts)
        bitmask = self._device[:num_rows]
        bitmask.copy_(host, non_blocking=True)
        return TokenMask(bitmask, self._shifts)
