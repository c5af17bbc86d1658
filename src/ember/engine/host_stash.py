"""Host memory that holds sleeping models' weights: chunks of pinned memory, bounded by a limit.

Pinning is slow (about 2 s for 4 GiB at once on the H200's host), so the chunks are pinned on
several threads while the first ones are already being copied into, and a chunk a woken model
gives back is kept for the next model that sleeps: only the first sleeps pay for pinning, and
not even those where the pool pins ahead (`reserve`) because its models cannot all fit. The
copies go on several CUDA streams (a copy engine each way). On a CPU device the chunks are plain
memory and the copies synchronous.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

CHUNK_BYTES = 256 << 20
PIN_THREADS = 8
COPY_STREAMS = 4


@dataclass
class Stashed:
    """One model's bytes on the host: ``chunks[i]`` holds bytes ``[i*chunk, (i+1)*chunk)``."""

    nbytes: int
    chunks: list[torch.Tensor]


class HostStash:
    """The process's pinned chunks; ``limit_bytes`` (None: none) bounds what it ever pins."""

    def __init__(self, limit_bytes: int | None, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self.chunk_bytes = chunk_bytes
        self._free: list[torch.Tensor] = []
        self.allocated_bytes = 0
        self._streams: dict[torch.device, list[torch.cuda.Stream]] = {}

    @property
    def used_bytes(self) -> int:
        return self.allocated_bytes - len(self._free) * self.chunk_bytes

    def can_hold(self, nbytes: int) -> bool:
        if self.limit_bytes is None:
            return True
        missing = max(0, self._chunks_for(nbytes) - len(self._free)) * self.chunk_bytes
        return self.allocated_bytes + missing <= self.limit_bytes

    def reserve(self, nbytes: int, device: torch.device) -> int:
        """Pin chunks now, within the limit, so that a later `store` of ``nbytes`` from
        ``device`` pins nothing; returns the bytes pinned. Nothing to do off a GPU."""
        if device.type != "cuda":
            return 0
        count = self._chunks_for(nbytes) - len(self._free)
        if self.limit_bytes is not None:
            count = min(count, (self.limit_bytes - self.allocated_bytes) // self.chunk_bytes)
        if count <= 0:
            return 0
        with ThreadPoolExecutor(PIN_THREADS, thread_name_prefix="pin") as pinning:
            chunks = list(pinning.map(lambda _: self._new_chunk(True), range(count)))
        self._free.extend(chunks)
        self.allocated_bytes += count * self.chunk_bytes
        return count * self.chunk_bytes

    def store(self, source: torch.Tensor) -> Stashed | None:
        """Copy the flat byte tensor ``source`` to host chunks and wait for the copies; None
        (nothing copied) when the limit leaves no room for it."""
        nbytes = source.numel()
        if not self.can_hold(nbytes):
            return None
        count = self._chunks_for(nbytes)
        reused = [self._free.pop() for _ in range(min(count, len(self._free)))]
        pin = source.device.type == "cuda"
        stashed = Stashed(nbytes, [])
        self.allocated_bytes += (count - len(reused)) * self.chunk_bytes
        with ThreadPoolExecutor(PIN_THREADS, thread_name_prefix="pin") as pinning:
            fresh = [pinning.submit(self._new_chunk, pin) for _ in range(count - len(reused))]
            streams = self._copy_streams(source.device)
            for i in range(count):
                chunk = reused[i] if i < len(reused) else fresh[i - len(reused)].result()
                stashed.chunks.append(chunk)
                start = i * self.chunk_bytes
                size = min(self.chunk_bytes, nbytes - start)
                self._copy(chunk[:size], source[start : start + size], streams, i)
        self._wait(streams)
        return stashed

    def load(self, stashed: Stashed, target: torch.Tensor) -> None:
        """Copy the stashed bytes into ``target`` and wait; the chunks return to the pool."""
        streams = self._copy_streams(target.device)
        for i, chunk in enumerate(stashed.chunks):
            start = i * self.chunk_bytes
            size = min(self.chunk_bytes, stashed.nbytes - start)
            self._copy(target[start : start + size], chunk[:size], streams, i)
        self._wait(streams)
        self.give_back(stashed)

    def give_back(self, stashed: Stashed) -> None:
        self._free.extend(stashed.chunks)
        stashed.chunks = []

    def _chunks_for(self, nbytes: int) -> int:
        return -(-nbytes // self.chunk_bytes)

    def _new_chunk(self, pin: bool) -> torch.Tensor:
        return torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=pin)

    def _copy_streams(self, device: torch.device) -> list[torch.cuda.Stream] | None:
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = [torch.cuda.Stream(device) for _ in range(COPY_STREAMS)]
        return self._streams[device]

    @staticmethod
    def _copy(
        dst: torch.Tensor, src: torch.Tensor, streams: list[torch.cuda.Stream] | None, i: int
    ) -> None:
        if streams is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(streams[i % len(streams)]):
            dst.copy_(src, non_blocking=True)

    @staticmethod
    def _wait(streams: list[torch.cuda.Stream] | None) -> None:
        for stream in streams or ():
            stream.synchronize()
