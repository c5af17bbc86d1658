"""One tensor-parallel rank's model shard, loaded from a checkpoint with the engine's own calls
and the ranks' shapes alone (`ShapeGroup`: loading needs no collective), and a checkpoint's
tensors read whole, for tests of what each rank reads."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from ember.config import engine_config
from ember.engine.device_arena import ArenaFactory
from ember.engine.model_parts import allocate_model, build_attention, load_weights
from ember.engine.model_plan import plan_model
from ember.kernels.tuning import KernelTuning
from ember.layers.ops import reference_ops
from ember.parallel.group import ShapeGroup

CPU = torch.device("cpu")


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``path``, by name."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return out


def load_rank(path: Path, rank: int, size: int, **options):
    """Rank ``rank`` of ``size``'s model, loaded; and the bytes it read."""
    config = engine_config(str(path), device="cpu", tensor_parallel_size=size, **options)
    plan = plan_model(config)
    ops = reference_ops()
    attention = build_attention(plan, ops, KernelTuning.for_device(CPU))
    model, _ = allocate_model(
        plan, ops, attention, ShapeGroup(rank, size), ArenaFactory(CPU), False
    )
    return model, load_weights(model, plan, None)
