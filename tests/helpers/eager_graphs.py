"""Stand-ins that run the CUDA-graph step paths on a CPU.

`EagerStepGraphs` replays a "graph" by running its forward pass eagerly over the padded buffers.
`PlannedReferenceAttention` plans and stages as the Triton backend does (chunk tile maps, graph
grids, decode split variants) but computes with the reference attention, so the runner's
staging for the fast path is checked without running a kernel.
"""

from __future__ import annotations

import dataclasses

import torch

from ember import LLM
from ember.config import StepLimits
from ember.kernels.attention_plan import AttentionPlanner, AttentionTuning
from ember.layers.attention import ReferenceAttention, TritonAttention
from ember.runner.cuda_graphs import GraphKey, StepGraphs


class PlannedReferenceAttention(TritonAttention):
    """The Triton backend's planning with the reference backend's arithmetic."""

    forward = ReferenceAttention.forward


def planned_attention(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    limits: StepLimits,
    tuning: AttentionTuning | None = None,
) -> PlannedReferenceAttention:
    """A planned reference backend for this shape (an H200's table unless ``tuning``)."""
    planner = AttentionPlanner(tuning or AttentionTuning(), num_q_heads, num_kv_heads, head_dim, 4)
    return PlannedReferenceAttention(planner, limits, torch.device("cpu"), lambda rows: False)


def llm_with_planned_attention(monkeypatch, *args, **kwargs) -> LLM:
    """``LLM(*args, **kwargs)`` on the CPU whose attention plans as Triton's does."""
    import ember.engine.model_parts as parts_module

    def select(ops, num_q_heads, num_kv_heads, head_dim, dtype, device, limits, *a, **k):
        return planned_attention(num_q_heads, num_kv_heads, head_dim, limits)

    monkeypatch.setattr(parts_module, "select_attention", select)
    return LLM(*args, **kwargs)


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
    def install(cls, llm: LLM, max_tokens: int, mixed: bool = True) -> EagerStepGraphs:
        """Replace ``llm``'s runner graphs (None on a CPU) with eager ones for steps of up to
        ``max_tokens`` tokens; returns them."""
        runner = llm.instance.runner
        limits = dataclasses.replace(runner.limits, max_num_batched_tokens=max_tokens)
        instance = llm.instance
        runner.graphs = cls(
            instance.model,
            runner.buffers,
            runner.attention,
            runner.kv_cache,
            runner.cos_sin_cache,
            limits,
            mixed=mixed,
        )
        return runner.graphs
