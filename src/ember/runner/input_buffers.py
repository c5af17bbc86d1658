"""Persistent step inputs: device tensors at fixed addresses (what CUDA graphs replay against)
and host staging buffers (pinned on CUDA) that numpy fills without allocating.

Host staging is double-buffered: step N+1 fills one set while step N's copies from the other
may still be queued on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class HostStaging:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    sample_indices: torch.Tensor
    gather_dst: torch.Tensor
    gather_src: torch.Tensor
    sampled: torch.Tensor  # where the step's sampled ids land (async copy from the device)

    def numpy(self, name: str) -> np.ndarray:
        return getattr(self, name).numpy()


class InputBuffers:
    """Device-side inputs of a step, sized for the largest step the scheduler can build."""

    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        num_kv_heads: int,
    ) -> None:
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        shapes = self._shapes()
        self.device_tensors = {
            name: torch.zeros(shape, dtype=dtype, device=device)
            for name, (shape, dtype) in shapes.items()
        }
        # Split-KV attention's arrival counters: zero between launches (the kernel re-zeroes
        # them), never staged from the host.
        self.split_kv_counters = torch.zeros(
            max_seqs * num_kv_heads, dtype=torch.int32, device=device
        )
        pin = device.type == "cuda"
        self._staging = [
            HostStaging(
                **{
                    name: torch.zeros(shape, dtype=dtype, pin_memory=pin)
                    for name, (shape, dtype) in shapes.items()
                }
            )
            for _ in range(2)
        ]
        self._turn = 0

    def _shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        t, s = self.max_tokens, self.max_seqs
        return {
            "input_ids": ((t,), torch.int64),
            "positions": ((t,), torch.int64),
            "slot_mapping": ((t,), torch.int64),
            "query_start_loc": ((s + 1,), torch.int32),
            "seq_lens": ((s,), torch.int32),
            "block_tables": ((s, self.max_blocks_per_seq), torch.int32),
            "sample_indices": ((s,), torch.int64),
            "gather_dst": ((s,), torch.int64),
            "gather_src": ((s,), torch.int64),
            "sampled": ((s,), torch.int64),
        }

    def next_staging(self) -> HostStaging:
        self._turn ^= 1
        return self._staging[self._turn]

    def upload(self, staging: HostStaging, counts: dict[str, int]) -> None:
        """Copy the first `counts[name]` rows of each staged array to the device, async."""
        for name, n in counts.items():
            if n:
                self.device_tensors[name][:n].copy_(getattr(staging, name)[:n], non_blocking=True)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.device_tensors[name]
