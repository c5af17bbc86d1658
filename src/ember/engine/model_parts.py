"""What a `ModelInstance` and a tensor-parallel worker both build from a plan: the attention
backend, the model's parameters as views of one arena, and its weights read into them. A worker
(`ember.parallel.worker`) builds its rank's share with the same calls, so the ranks can never
be built two ways.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ember.engine.device_arena import ArenaFactory, arena_bytes, carve
from ember.engine.model_plan import ModelPlan
from ember.kernels.tuning import KernelTuning
from ember.layers.attention import AttentionBackend, select_attention
from ember.layers.ops import Ops
from ember.layers.reference_ops import build_cos_sin_cache
from ember.models.registry import model_class
from ember.parallel.group import ParallelGroup
from ember.weights.dummy_weights import fill_dummy_weights
from ember.weights.parallel_load import load_extents
from ember.weights.safetensors_layout import slice_extent


def build_attention(plan: ModelPlan, ops: Ops, tuning: KernelTuning) -> AttentionBackend:
    """The attention backend of one rank's heads (all of them at tensor_parallel_size 1)."""
    cfg = plan.rank_config
    return select_attention(
        ops,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        plan.dtype,
        plan.device,
        plan.limits,
        tuning.attention,
        fuse_decode=plan.config.decode_rope_in_attention,
        kv_dtype=plan.kv_dtype,
    )


def allocate_model(
    plan: ModelPlan,
    ops: Ops,
    attention: AttentionBackend,
    parallel: ParallelGroup,
    arenas: ArenaFactory,
    zeroed: bool,
):
    """The model (this rank's share over ``parallel``) with its parameters as views of one
    arena, their values not yet read; returns ``(model, arena)``. ``zeroed``: the arena is
    zeroed (a compile pass may run the model before its weights land)."""
    cls = model_class(plan.model_config.architecture)
    with torch.device("meta"):
        model = cls(plan.model_config, ops, attention, parallel)
    model = model.cast_to(plan.dtype)  # FP8 weights and their scales keep their dtypes
    params = list(model.parameters())
    shapes = [(tuple(p.shape), p.dtype) for p in params]
    arena = arenas.make(arena_bytes(shapes))
    views = {id(p): view for p, view in zip(params, carve(arena, shapes))}
    model = model._apply(lambda tensor: views[id(tensor)])  # new Parameters, arena views
    if zeroed:
        arena.buffer.zero_()
    return model.eval(), arena


class PooledKVCache:
    """The KV cache of a model whose windowed layers keep their K/V in a pool of their own:
    ``[2, blocks, block_size, kv_heads, head_dim]`` per layer, as a model reads a
    ``[layers, 2, ...]`` cache's (``kv_cache[layer]``), each a view of its pool's tensor."""

    def __init__(self, pools: list[torch.Tensor], layers: list[torch.Tensor]) -> None:
        self.pools, self.layers = pools, layers

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def device(self) -> torch.device:
        return self.pools[0].device

    def zero_(self) -> PooledKVCache:
        for pool in self.pools:
            pool.zero_()
        return self


def allocate_kv_cache(plan: ModelPlan, num_blocks: int, arenas: ArenaFactory):
    """The paged KV cache of ``num_blocks`` blocks (of this rank's KV heads), zeroed, in an
    arena of its own; returns ``(kv_cache, arena)``: a ``[layers, 2, blocks, ...]`` tensor, or
    with local layers (`ModelPlan.kv_local_layers`) a `PooledKVCache` whose local layers' pool
    holds `ModelPlan.local_kv_blocks`."""
    cfg, block_size = plan.rank_config, plan.config.cache.block_size
    page = (block_size, cfg.num_kv_heads, cfg.head_dim)
    local = plan.local_layers
    if not local:
        kv_layout = [((cfg.num_layers, 2, num_blocks, *page), plan.kv_dtype)]
    else:
        local_blocks = plan.local_kv_blocks(num_blocks)
        kv_layout = [
            ((cfg.num_layers - len(local), 2, num_blocks, *page), plan.kv_dtype),
            ((len(local), 2, local_blocks, *page), plan.kv_dtype),
        ]
    arena = arenas.make(arena_bytes(kv_layout))
    pools = carve(arena, kv_layout)
    for pool in pools:
        pool.zero_()
    if not local:
        return pools[0], arena
    main, local_pool = iter(pools[0]), iter(pools[1])
    layers = [next(local_pool if i in local else main) for i in range(cfg.num_layers)]
    return PooledKVCache(pools, layers), arena


def cos_sin_cache(plan: ModelPlan) -> torch.Tensor:
    """RoPE's cos and sin table for every position the model serves, on its device."""
    cfg = plan.model_config
    return build_cos_sin_cache(
        cfg.head_dim, plan.max_model_len, cfg.rope_theta, cfg.rope_scaling
    ).to(plan.device)


def load_weights(
    model: torch.nn.Module, plan: ModelPlan, on_tensor: Callable[[int], None] | None
) -> int:
    """Fill the parameters from the plan's checkpoint; returns the checkpoint bytes read (0:
    not counted, a source read tensor by tensor). Safetensors files are read on several
    threads through pinned buffers (`ember.weights.parallel_load`), each tensor-parallel rank
    reading only its slices; other formats tensor by tensor through `Checkpoint.iter_tensors`,
    each rank keeping its slice. ValueError naming the tensor and its file if a loaded tensor
    holds a NaN or an infinity. Weights quantized at load land a layer at a time, so one
    layer's float weights are held at most. Dummy weights are made on the device instead, the
    same each time."""
    ckpt = plan.checkpoint
    extents = getattr(ckpt, "tensor_extents", None)
    headers = plan.tensor_headers  # to name a bad tensor's file
    if plan.config.dummy_weights:
        make_dummy_weights(model, plan)
        return 0
    if extents is None:
        model.load_weights(ckpt.iter_tensors(plan.dtype), on_tensor, headers)
        return 0
    placer = model.weight_placer(headers)
    grouped = placer.transforms

    def sliced(extent):
        part = placer.slice_of(extent.name, extent.shape)
        if part is None:
            return extent
        return slice_extent(extent, part.dim, part.start, part.length, part.parts)

    read = load_extents(
        [sliced(extent) for extent in extents()],
        lambda extent: placer.target(extent.name, extent.shape, extent.dtype),
        plan.device,
        on_tensor=on_tensor,
        files=getattr(ckpt, "weight_files", None),
        group_of=(lambda extent: placer.load_group(extent.name)) if grouped else None,
        after_group=placer.transform_landed if grouped else None,
    )
    placer.finish()
    return read


def make_dummy_weights(model: torch.nn.Module, plan: ModelPlan) -> None:
    """Random weights, seeded by the config's seed (`ember.weights.dummy_weights`); the
    output head's rows past the tokenizer's ids zero (of this rank's slice of them)."""
    cfg = plan.model_config
    embeddings = model.embed_tokens
    head = embeddings.weight if cfg.tie_word_embeddings else model.lm_head
    text_ids = plan.tokenizer.vocab_size
    local = None
    if text_ids < cfg.vocab_size:
        local = min(max(text_ids - embeddings.first_id, 0), head.shape[0])
    fill_dummy_weights(model, plan.config.seed, head, local)
