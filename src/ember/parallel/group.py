"""The ranks of one tensor-parallel model and the collectives its layers call.

A model holds one `ParallelGroup`. The base class is a group of one rank whose collectives
return their input untouched, so a model at ``tensor_parallel_size`` 1 runs the code it ran
before tensor parallelism existed. `TorchParallelGroup` is a group of several processes over a
`torch.distributed` process group of its own (NCCL on GPUs, gloo on the CPU), built from a
store rather than `init_process_group`: torch's default group is process-wide state, and an
engine process may hold several models, each with its own ranks.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

# How long a collective (or the group's rendezvous) may wait for the other ranks before it
# fails: long enough for a rank's first step to compile its kernels. A rank that dies is found
# much sooner (`ember.parallel.workers`).
COLLECTIVE_TIMEOUT_S = 600.0


class ParallelGroup:
    """One rank of ``size``; the collectives of a group of one (no-ops)."""

    rank = 0
    size = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise largest of ``tensor`` over the ranks, in place; returns it."""
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``tensor`` (same shape on all) side by side along the last dimension,
        on rank 0; None on the others."""
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` into every rank's, in place; returns it."""
        return tensor

    def close(self) -> None:
        """Let go of the group's connections."""


class ShapeGroup(ParallelGroup):
    """A rank's place in a group, without connections: what a model is built with to size its
    shards (a plan counting a rank's bytes); its collectives must never run."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a ShapeGroup only sizes shards; it runs no collective")

    all_reduce_max = gather_to_first = broadcast = all_reduce


class TorchParallelGroup(ParallelGroup):
    """Rank ``rank`` of ``size`` processes that meet through ``store`` (the same store, or a
    client of it, in each); NCCL on a CUDA ``device``, gloo on the CPU. Blocks until every
    rank has joined."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        device: torch.device,
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
    ) -> None:
        self.rank, self.size, self.device = rank, size, device
        prefixed = dist.PrefixStore("ember-tp", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        else:
            self._group = dist.ProcessGroupGloo(prefixed, rank, size, timeout)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        # NCCL: wait() makes the current stream wait, the host goes on; gloo: the host waits.
        self._group.allreduce([tensor]).wait()
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        self._group.allreduce([tensor], options).wait()
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> torch.Tensor | None:
        options = dist.GatherOptions()
        options.rootRank = 0
        tensor = tensor.contiguous()
        if self.rank != 0:
            self._group.gather([], [tensor], options).wait()
            return None
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._group.gather([parts], [tensor], options).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._group.broadcast([tensor], options).wait()
        return tensor

    def abort(self) -> None:
        """Make every collective in flight fail now (a rank is gone): NCCL's kernels would
        otherwise wait for it until the timeout; gloo's fail on their own."""
        abort = getattr(self._group, "abort", None)
        if self.device.type == "cuda" and abort is not None:
            abort()

    def close(self) -> None:
        self._group = None
