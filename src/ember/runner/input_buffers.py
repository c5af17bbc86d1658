"""Persistent step inputs: device tensors at fixed addresses (what CUDA graphs replay against)
and host staging buffers (pinned on CUDA) that numpy fills without allocating.

A block's inputs live in one device buffer, each a view at a fixed offset, and each host
staging set is one pinned buffer with the same layout. An upload copies the used rows of
every input, and merges copies that the layout puts close together: a host-to-device copy
costs ~2-3 us on the GPU whatever its size at these sizes, so a decode step's eight inputs go
in one copy (a step A/B; bench/results/README.md, "Step input copies").

Two blocks: the general one sized for the largest step, and a decode block where every
input has one row per sequence. Its arrays are short, so a decode step's used rows span a few
KiB and go in one copy. In the general block the token arrays are thousands of rows, so their
unused tails stay behind.

Host staging is double-buffered: step N+1 fills one set while step N's copies from the other
may still be queued on the GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from ember.config import StepLimits
from ember.layers.attention import ArrayLayout, AttentionBackend

_ALIGN = 16
# Copy the gap between two used runs rather than start another copy when it is this small:
# ~20 KiB moves in the time a copy takes to start.
MERGE_GAP_BYTES = 16 * 1024


def _layout(
    t: int, s: int, max_blocks_per_seq: int, extra: ArrayLayout
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Inputs in layout order: the short per-sequence arrays first, then the attention backend's
    ``extra`` arrays, then the per-token ones, the block tables (the widest rows) last, so a
    step's used rows form as few runs as possible."""
    return {
        "query_start_loc": ((s + 1,), torch.int32),
        "seq_lens": ((s,), torch.int32),
        "sample_indices": ((s,), torch.int64),
        "gather_dst": ((s,), torch.int64),
        "gather_src": ((s,), torch.int64),
        **extra,
        "input_ids": ((t,), torch.int64),
        "positions": ((t,), torch.int64),
        "slot_mapping": ((t,), torch.int64),
        "block_tables": ((s, max_blocks_per_seq), torch.int32),
    }


def _row_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize


def merged_runs(runs: list[tuple[int, int]], max_gap: int) -> list[tuple[int, int]]:
    """Byte ranges ``(start, end)`` sorted by start, merged where the gap between two is at
    most ``max_gap``; empty ranges dropped."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(r for r in runs if r[1] > r[0]):
        if merged and start - merged[-1][1] <= max_gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


class HostStaging:
    """One host copy of a block's inputs (views of one buffer) and where the step's sampled ids
    land (an async copy from the device)."""

    def __init__(self, packed: torch.Tensor, views: dict[str, torch.Tensor], sampled: torch.Tensor):
        self.packed, self.views, self.sampled = packed, views, sampled

    def numpy(self, name: str) -> np.ndarray:
        return self.views[name].numpy()


class InputBlock:
    """A step layout's inputs on the device, with two host staging sets."""

    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        extra: ArrayLayout | None = None,
    ) -> None:
        self.layout = _layout(max_tokens, max_seqs, max_blocks_per_seq, extra or {})
        self.offsets: dict[str, int] = {}
        size = 0
        for name, (shape, dtype) in self.layout.items():
            size = -(-size // _ALIGN) * _ALIGN
            self.offsets[name] = size
            size += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self.nbytes = size
        self.device_buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        self.device_tensors = self._views(self.device_buffer)
        pin = device.type == "cuda"
        self._staging = []
        for _ in range(2):
            packed = torch.zeros(size, dtype=torch.uint8, pin_memory=pin)
            sampled = torch.zeros(max_seqs, dtype=torch.int64, pin_memory=pin)
            self._staging.append(HostStaging(packed, self._views(packed), sampled))
        self._turn = 0

    def _views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        views = {}
        for name, (shape, dtype) in self.layout.items():
            count = int(np.prod(shape, dtype=np.int64))
            start = self.offsets[name]
            raw = buffer[start : start + count * dtype.itemsize]
            views[name] = raw.view(dtype).view(shape)
        return views

    def next_staging(self) -> HostStaging:
        self._turn ^= 1
        return self._staging[self._turn]

    def upload_runs(self, counts: dict[str, int]) -> list[tuple[int, int]]:
        """The byte ranges an upload of the first ``counts[name]`` rows of each input copies."""
        runs = []
        for name, n in counts.items():
            shape, dtype = self.layout[name]
            start = self.offsets[name]
            runs.append((start, start + n * _row_bytes(shape, dtype)))
        return merged_runs(runs, MERGE_GAP_BYTES)

    def upload(self, staging: HostStaging, counts: dict[str, int]) -> None:
        """Copy the first ``counts[name]`` rows of each staged input to the device, async."""
        for start, end in self.upload_runs(counts):
            self.device_buffer[start:end].copy_(staging.packed[start:end], non_blocking=True)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.device_tensors[name]


def _local_arrays(t: int, s: int, max_blocks_per_seq: int, local: bool) -> ArrayLayout:
    """The local layers' slot mapping and block tables (none without local layers)."""
    if not local:
        return {}
    return {
        "local_slot_mapping": ((t,), torch.int64),
        "local_block_tables": ((s, max_blocks_per_seq), torch.int32),
    }


class InputBuffers:
    """Device-side inputs of a step, sized for the largest step the limits allow: the general
    block (with the attention backend's arrays), and the decode block for steps of one token per
    sequence."""

    def __init__(
        self,
        limits: StepLimits,
        block_size: int,
        device: torch.device,
        attention: AttentionBackend,
        local: bool = False,
    ) -> None:
        """``local``: the windowed layers have a pool of their own, whose slot mapping and
        block tables each block stages too."""
        max_seqs = limits.max_num_seqs
        max_blocks_per_seq = -(-limits.max_model_len // block_size)
        t = limits.max_step_tokens
        general = {
            **attention.step_arrays(),
            **_local_arrays(t, max_seqs, max_blocks_per_seq, local),
        }
        self.general = InputBlock(t, max_seqs, max_blocks_per_seq, device, general)
        # Decode steps have no chunks: the decode block stages nothing for attention.
        decode = _local_arrays(max_seqs, max_seqs, max_blocks_per_seq, local)
        self.decode = InputBlock(max_seqs, max_seqs, max_blocks_per_seq, device, decode)

    def block(self, decode: bool) -> InputBlock:
        return self.decode if decode else self.general
