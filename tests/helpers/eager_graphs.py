"""A stand-in for CUDA graph replay that runs on a CPU."""

from __future__ import annotations

import torch

from ember.runner.cuda_graphs import GraphKey, StepGraphs


class EagerStepGraphs(StepGraphs):
    """StepGraphs whose 'replay' runs the captured function eagerly (no CUDA needed)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.replayed: list[tuple[GraphKey, int]] = []  # (key, tokens that write KV)

    def capture(self, key: GraphKey) -> None:
        """Run the pass a capture would record, eagerly, over the buffers as they are."""
        self._graphs[key] = (None, self._forward(key))

    def replay(self, key: GraphKey) -> torch.Tensor:
        slots = self.buffers.block(key.decode)["slot_mapping"]
        real = int((slots[: key.num_tokens] >= 0).sum())
        self.replayed.append((key, real))
        return self._forward(key)

    @classmethod
    def install(cls, llm, max_tokens: int, **graph_options) -> EagerStepGraphs:
        """Replace ``llm``'s runner graphs (None on a CPU) with eager ones; returns them."""
        runner, config = llm.instance.runner, llm.instance.config.scheduler
        graph_options.setdefault("chunk_tile_tokens", runner.chunk_tile_tokens)
        runner.graphs = cls(
            llm.instance.model, runner.buffers, runner.kv_cache, runner.cos_sin_cache,
            max_batch=config.max_num_seqs, max_seq_len=llm.instance.max_model_len,
            max_tokens=max_tokens, **graph_options,
        )  # fmt: skip
        return runner.graphs
