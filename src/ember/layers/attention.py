"""Attention for one model instance: the op its layers call, and what a step must carry for it.

The runner never looks inside attention. It asks the instance's `AttentionBackend` for the
arrays a step stages beside its own inputs (`step_arrays`), to fill them for a step (`stage`)
and pad them for a CUDA graph (`graph_grid`, `pad_for_graph`), which decode graphs plan alike
(`decode_variant`), and for the step's metadata that a forward pass carries to the layers
(`metadata`, in `ForwardContext.attention`); the layers call `forward`.

`ReferenceAttention` is plain PyTorch (the CPU path and the oracle) and needs nothing staged.
`TritonAttention` plans its kernel's launches from the model's shape and the device's
`AttentionTuning` (`ember.kernels.attention_plan`), stages the map of a mixed step's chunk tiles,
and keeps the split path's arrival counters, whose addresses a captured graph reuses.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ember.config import StepLimits
from ember.dependencies import require_triton
from ember.kernels.attention_plan import (
    AttentionLaunch,
    AttentionPlanner,
    AttentionTuning,
    ChunkTiles,
)
from ember.layers.forward_context import ForwardContext
from ember.layers.reference_ops import rope_and_attention_reference
from ember.layers.row_norm import RowNorm

# What a backend adds to a step's inputs: array name -> (shape, dtype).
ArrayLayout = dict[str, tuple[tuple[int, ...], torch.dtype]]


class Staging(Protocol):
    """The runner's host staging set, as a backend fills it: the numpy view of one array."""

    def numpy(self, name: str) -> np.ndarray: ...


@dataclass
class StagedAttention:
    """What a backend staged for one step: the rows of each of its arrays to upload, and the
    programs its launch over them needs (a mixed graph must offer at least as many)."""

    uploads: dict[str, int] = field(default_factory=dict)
    grid: int = 0


class AttentionBackend:
    """The interface, and the behaviour of a backend that needs nothing staged. A backend
    serves the steps one instance's `StepLimits` allow."""

    # Whether `forward` takes the ``qk_norm`` option; a layer whose backend does not runs
    # Qwen3's q/k norms itself first.
    takes_qk_norm = False

    def __init__(self, limits: StepLimits | None = None) -> None:
        self.limits = limits or StepLimits()

    def step_arrays(self) -> ArrayLayout:
        """Arrays a step with prefill chunks stages beside the runner's own, sized for the
        largest step."""
        return {}

    def stage(self, staging: Staging, num_seqs: int, max_query_len: int) -> StagedAttention:
        """Fill this step's arrays in ``staging``, whose ``query_start_loc`` is staged."""
        return StagedAttention()

    def graph_grid(self, num_tokens: int) -> int | None:
        """The programs a mixed-step graph of ``num_tokens`` offers (None: no limit): a step
        whose `StagedAttention.grid` is larger takes a larger graph."""
        return None

    def pad_for_graph(
        self, staging: Staging, staged: StagedAttention, grid: int | None
    ) -> StagedAttention:
        """Pad the staged arrays to a mixed graph's ``grid`` (its spare entries do nothing)."""
        return staged

    def decode_variant(self, batch: int, max_seq_len: int) -> Hashable:
        """What a decode step of ``batch`` sequences up to ``max_seq_len`` tokens plans by:
        decode graphs whose variants are equal are one graph."""
        return None

    def metadata(
        self,
        arrays: Mapping[str, torch.Tensor],
        staged: StagedAttention,
        num_seqs: int,
        max_query_len: int,
        max_seq_len: int,
    ) -> Any:
        """The step's metadata for `forward`, over the device ``arrays`` the step staged into."""
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        cos_sin_cache: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        row_norm: RowNorm | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """RoPE on q and k, this step's keys and values into the cache, then causal attention
        of the step's queries over the cache into ``out`` (returned). ``row_norm``: q, k and v
        are products of un-normalised rows, to scale by each token's ``1/rms`` first.
        ``kv_scales``: the layer's ``(k_scale, v_scale)`` of an FP8 cache, which stores
        ``x / scale`` and reads ``stored * scale`` (docs/CONTRACTS.md, "FP8 KV cache"); ignored
        by a cache of any other dtype. The layer's kind, where it is not plain (docs/CONTRACTS.md,
        "Windows, sinks, chunks"): ``window`` or ``chunk_size`` (int), ``sinks`` (a tensor
        ``[num_q_heads]``), ``use_rope`` (False: a NoPE layer), ``qk_norm`` (a
        `ember.layers.qk_norm.QkNorm`: Qwen3's RMSNorm of each head of q and k before RoPE, where
        `takes_qk_norm`), ``qk_l2_norm_eps`` (float: Llama 4's L2 norm after RoPE; not with
        ``qk_norm``)."""
        raise NotImplementedError


class ReferenceAttention(AttentionBackend):
    """Plain PyTorch, one sequence at a time in float32."""

    takes_qk_norm = True

    def forward(self, q, k, v, ctx, cos_sin_cache, k_cache, v_cache, scale, out, **options):
        return rope_and_attention_reference(
            q, k, v, ctx, cos_sin_cache, k_cache, v_cache, scale, out, **options
        )


@dataclass(frozen=True)
class TritonStepAttention:
    """A step's launches of the attention kernel and, for a mixed step, its chunk tile map."""

    launches: tuple[AttentionLaunch, ...]
    chunk_tiles: ChunkTiles | None = None


class TritonAttention(AttentionBackend):
    """The Triton kernels, planned by an `AttentionPlanner` for this model on this GPU.

    ``launches_with_pdl(rows)``: whether a step of that many tokens launches with PDL (the
    instance's ops decide). ``fuse_decode``: decode steps rotate and write the cache inside the
    attention kernel (a launch less per layer). A mixed graph's chunk launch has a partial tile
    for each of up to ``chunk_slack`` chunks beside a full tile per chunk query tile of its
    tokens (a step's new prompts, a burst of arrivals included); a step with more chunks takes a
    larger graph, or runs eagerly.
    """

    takes_qk_norm = True

    def __init__(
        self,
        planner: AttentionPlanner,
        limits: StepLimits,
        device: torch.device,
        launches_with_pdl: Callable[[int], bool],
        fuse_decode: bool = True,
        chunk_slack: int = 16,
    ) -> None:
        require_triton()
        from ember.kernels.attention_step import rope_and_attention

        super().__init__(limits)
        self._rope_and_attention = rope_and_attention  # the kernels' entry, imported once
        max_seqs = limits.max_num_seqs
        self.planner = planner
        self.launches_with_pdl = launches_with_pdl
        self.fuse_decode = fuse_decode
        self.chunk_slack = chunk_slack
        # Split-KV attention's arrival counters: zero between launches (the kernel re-zeroes
        # them), never staged from the host.
        self.split_counters = torch.zeros(
            max_seqs * planner.num_kv_heads, dtype=torch.int32, device=device
        )
        self._mixed_launches = planner.mixed_plan()  # the same for every mixed step

    def step_arrays(self) -> ArrayLayout:
        # Sized to the bound, not to the tokens: in the runner's layout its unused tail lies
        # between short arrays that one copy uploads together.
        limits = self.limits
        bound = self.planner.chunk_tile_bound(limits.max_step_tokens, limits.max_num_seqs)
        return {"chunk_tiles": ((bound,), torch.int32)}

    def stage(self, staging: Staging, num_seqs: int, max_query_len: int) -> StagedAttention:
        if max_query_len <= 1:
            return StagedAttention()
        count = self.planner.chunk_tile_map(
            staging.numpy("query_start_loc"), num_seqs, staging.numpy("chunk_tiles")
        )
        return StagedAttention({"chunk_tiles": count}, count)

    def graph_grid(self, num_tokens: int) -> int | None:
        spare = min(self.chunk_slack, self.limits.max_num_seqs)
        return self.planner.chunk_tile_bound(num_tokens, spare)

    def pad_for_graph(
        self, staging: Staging, staged: StagedAttention, grid: int | None
    ) -> StagedAttention:
        staging.numpy("chunk_tiles")[staged.grid : grid] = -1
        return StagedAttention({"chunk_tiles": grid}, grid)

    def decode_variant(self, batch: int, max_seq_len: int) -> Hashable:
        return self.planner.num_splits(batch, max_seq_len)

    def metadata(self, arrays, staged, num_seqs, max_query_len, max_seq_len) -> TritonStepAttention:
        if max_query_len != 1:
            chunk_tiles = None
            if staged.grid:
                chunk_tiles = ChunkTiles(
                    arrays["chunk_tiles"], staged.grid, self.planner.chunk_query_tile
                )
            return TritonStepAttention(self._mixed_launches, chunk_tiles)
        pdl = self.launches_with_pdl(num_seqs)  # a decode step's rows are its sequences
        return TritonStepAttention(self.planner.decode_plan(num_seqs, max_seq_len, pdl=pdl))

    def forward(self, q, k, v, ctx, cos_sin_cache, k_cache, v_cache, scale, out, **options):
        step = ctx.attention
        if step is None:  # a forward pass the runner did not stage (a test's own context)
            step = self.metadata(
                {}, StagedAttention(), ctx.seq_lens.shape[0], ctx.max_query_len, ctx.max_seq_len
            )
        return self._rope_and_attention(
            q,
            k,
            v,
            ctx,
            cos_sin_cache,
            k_cache,
            v_cache,
            scale,
            out,
            step.launches,
            split_counters=self.split_counters,
            chunk_tiles=step.chunk_tiles,
            fuse_decode=self.fuse_decode,
            pdl=self.launches_with_pdl(q.shape[0]),
            fp8_widen_in_registers=self.planner.tuning.kv_fp8_widen_in_registers,
            **options,
        )


def select_attention(
    ops,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    limits: StepLimits,
    tuning: AttentionTuning | None = None,
    fuse_decode: bool = True,
    kv_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """The attention backend for a model on ``ops``: Triton's where the ops are Triton's (planned
    by ``tuning``, an `AttentionTuning`; None: the device's), else the reference. ``dtype`` is
    the model's (its queries'), ``kv_dtype`` the KV cache's (None: the model's)."""
    if ops.name != "triton":
        return ReferenceAttention(limits)
    _check_fp8_cache_supported(kv_dtype, device)
    tuning = tuning or AttentionTuning.for_device(device)
    query_bytes = torch.empty((), dtype=dtype).element_size()
    kv_bytes = torch.empty((), dtype=kv_dtype or dtype).element_size()
    planner = AttentionPlanner(
        tuning, num_q_heads, num_kv_heads, head_dim, kv_bytes, query_elem_bytes=query_bytes
    )
    return TritonAttention(planner, limits, device, ops.launches_with_pdl, fuse_decode)


def _check_fp8_cache_supported(kv_dtype: torch.dtype | None, device: torch.device) -> None:
    """Triton converts float8 e4m3 on GPUs of compute capability 8.9 (Ada, Hopper) and later;
    on an older one, say so here rather than in a kernel's compile error."""
    if kv_dtype != torch.float8_e4m3fn or device.type != "cuda":
        return
    if torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(
            "an FP8 KV cache on the Triton path needs a GPU of compute capability 8.9 or later; "
            "use kv_cache_dtype='auto', or backend='reference'"
        )
