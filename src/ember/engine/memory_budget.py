"""The engine's one memory budget: the only object that decides what fits on the device.

Every model's holding is charged here by name (weights, KV cache, reserve while loaded; what
stays resident while it sleeps), so a load can tell how much it may take and what it would have
to evict first. The models never size themselves against the device's free memory.
"""

from __future__ import annotations

import gc

import torch

from ember.config import MemoryConfig


class MemoryBudget:
    """Bytes held per model against a total (None: no limit, the CPU default)."""

    def __init__(self, total_bytes: int | None) -> None:
        self.total_bytes = total_bytes
        self._held: dict[str, int] = {}

    @classmethod
    def for_device(cls, memory: MemoryConfig, device: torch.device) -> MemoryBudget:
        """The budget of an engine on ``device``: the configured bytes, else on a GPU its share
        of the whole device less what others (and this process's CUDA context) already use."""
        if memory.memory_budget_bytes is not None:
            return cls(memory.memory_budget_bytes)
        if device.type != "cuda":
            return cls(None)
        # An earlier engine of this process that is no longer referred to (an `LLM` dropped in a
        # reference cycle), and memory PyTorch keeps cached for freed tensors, are not another's:
        # collect and give them back before counting what is in use.
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return cls(int(total * memory.gpu_memory_utilization) - (total - free))

    @property
    def held_bytes(self) -> int:
        return sum(self._held.values())

    @property
    def free_bytes(self) -> int | None:
        if self.total_bytes is None:
            return None
        return self.total_bytes - self.held_bytes

    def held_by(self, name: str) -> int:
        return self._held.get(name, 0)

    def fits(self, nbytes: int) -> bool:
        free = self.free_bytes
        return free is None or nbytes <= free

    def hold(self, name: str, nbytes: int) -> None:
        """Set what ``name`` holds (replacing its previous charge)."""
        if nbytes > 0:
            self._held[name] = nbytes
        else:
            self._held.pop(name, None)
