"""The tensors a model of one config reads from its checkpoint, and the checks of a checkpoint's
headers against them: names and shapes alone, so a bad checkpoint fails before a byte of the
model is allocated or read, naming the tensor and its file.

Everything a load builds (the model, its weight arena, its KV cache) is sized from the config,
so `check_fits` runs while the model is planned: without it a config claiming far more layers
than its file holds builds and allocates all of them before the loader notices. `check_complete`
(every tensor the model reads is there) runs when the model loads, before it is allocated: a
tensor missing from a layer the file holds sizes nothing wrongly, and a server still accepts
the model and reports the failure as its load's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from ember.weights.checkpoint import TensorHeader

LAYER_PREFIX = "model.layers."
_LAYER_NAME = re.compile(re.escape(LAYER_PREFIX) + r"(\d+)\.(.+)")

# A tensor's expected shape, or the shapes it may take (an FP8 scale: ``[]`` or ``[1]``).
Shape = tuple[int, ...]
Shapes = Shape | frozenset[Shape]


def layer_of(name: str) -> int | None:
    """The decoder layer a checkpoint tensor belongs to (``model.layers.{i}.``), or None."""
    match = _LAYER_NAME.fullmatch(name)
    return int(match[1]) if match is not None else None


def _none(layer: int) -> Mapping[str, Shapes]:
    return {}


@dataclass(frozen=True)
class CheckpointLayout:
    """The checkpoint tensors (Hugging Face names) a model reads, with their shapes: ``shared``
    by full name, ``per_layer`` by the name after ``model.layers.{i}.`` for each of
    ``num_layers`` layers, and ``layer_specific(i)`` (the same way) those of layer i alone (a
    mixture-of-experts model's experts, or its dense MLP). ``ignores(name)``: a tensor a
    checkpoint may hold that the model does not read (RoPE's ``inv_freq``, a tied model's
    head). ``optional_per_layer``: tensors a layer may hold, read when present (an FP8
    checkpoint's activation and KV-cache scales). A shape given as a frozenset lists the shapes
    a tensor may take. ``prefix``: what the checkpoint's names of these tensors start with (a
    multimodal checkpoint's text model: Llama 4's ``language_model.``); the names above are
    after it."""

    architecture: str
    num_layers: int
    shared: Mapping[str, Shapes]
    per_layer: Mapping[str, Shapes]
    ignores: Callable[[str], bool]
    optional_per_layer: Mapping[str, Shapes] = field(default_factory=dict)
    layer_specific: Callable[[int], Mapping[str, Shapes]] = _none
    prefix: str = ""

    def names(self) -> Iterator[str]:
        """Every tensor the model reads, layer by layer; lazy, so that a reader stopping at the
        first one absent pays for the layers the checkpoint holds, not those the config claims."""
        for name in self.shared:
            yield self.prefix + name
        for layer in range(self.num_layers):
            for suffix in (*self.per_layer, *self.layer_specific(layer)):
                yield f"{self.prefix}{LAYER_PREFIX}{layer}.{suffix}"

    def layer_of(self, name: str) -> int | None:
        """The decoder layer checkpoint tensor ``name`` belongs to, or None."""
        return layer_of(name[len(self.prefix) :]) if name.startswith(self.prefix) else None

    def shape_of(self, name: str) -> Shapes | None:
        """The shape (or shapes) the model reads tensor ``name`` as, or None if it reads no such
        tensor (an optional one included)."""
        if not name.startswith(self.prefix):
            return None
        name = name[len(self.prefix) :]
        if match := _LAYER_NAME.fullmatch(name):
            layer, suffix = int(match[1]), match[2]
            if layer >= self.num_layers:
                return None
            for table in (self.per_layer, self.layer_specific(layer), self.optional_per_layer):
                if suffix in table:
                    return table[suffix]
            return None
        return self.shared.get(name)

    def problem_with(self, name: str, shape: tuple[int, ...]) -> str | None:
        """Why the checkpoint tensor ``name`` of ``shape`` has no place here, or None."""
        layer = self.layer_of(name)
        if layer is not None and layer >= self.num_layers:
            return (
                f"belongs to layer {layer}, but the config has num_hidden_layers={self.num_layers}"
            )
        expected = self.shape_of(name)
        if expected is None:
            return f"is not a tensor that {self.architecture} reads"
        if isinstance(expected, frozenset):
            if tuple(shape) not in expected:
                wanted = " or ".join(str(s) for s in sorted(expected))
                return f"has shape {tuple(shape)}, but the config gives it {wanted}"
        elif tuple(shape) != expected:
            return f"has shape {tuple(shape)}, but the config gives it {expected}"
        return None


def check_fits(layout: CheckpointLayout, headers: Sequence[TensorHeader]) -> None:
    """ValueError naming the tensor and its file unless every tensor of ``headers`` has a place
    of its shape in ``layout`` (none extra, none twice) and the checkpoint holds every layer
    the layout counts: the sizes a plan takes from the config agree with the tensors. Reads
    names and shapes only, and stops at the first layer absent, so a config claiming far more
    layers than the file holds costs what the file holds."""
    present: set[str] = set()
    for header in headers:
        if layout.ignores(header.name):
            continue
        if header.name in present:
            raise ValueError(f"{header.describe()} appears in the checkpoint twice")
        problem = layout.problem_with(header.name, header.shape)
        if problem is not None:
            raise ValueError(f"{header.describe()} {problem}")
        present.add(header.name)
    held = {layer for layer in map(layout.layer_of, present) if layer is not None}
    absent = next((layer for layer in range(layout.num_layers) if layer not in held), None)
    if absent is not None:
        name = f"{layout.prefix}{LAYER_PREFIX}{absent}.{next(iter(layout.per_layer))}"
        raise ValueError(
            f"{_files(headers)}: no tensor {name!r}: the config has num_hidden_layers="
            f"{layout.num_layers}, the checkpoint holds tensors of {len(held)} layers"
        )


def check_complete(layout: CheckpointLayout, headers: Sequence[TensorHeader]) -> None:
    """ValueError naming the file and the tensor if ``headers`` lack one that ``layout`` reads.
    Reads names only."""
    present = {header.name for header in headers}
    for name in layout.names():
        if name not in present:
            raise ValueError(
                f"{_files(headers)}: no tensor {name!r}, which {layout.architecture} reads"
            )


def _files(headers: Sequence[TensorHeader]) -> str:
    """The checkpoint's weight file, or its folder and how many files it holds."""
    paths = sorted({header.path for header in headers})
    if len(paths) == 1:
        return str(paths[0])
    if not paths:
        return "the checkpoint"
    return f"{paths[0].parent} ({len(paths)} weight files)"
