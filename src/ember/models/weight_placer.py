"""Where each checkpoint tensor lands in a model's parameters, and what is done with it there.

A loader asks `WeightPlacer.target` for each tensor (by its Hugging Face name), copies the bytes
into what it gets, and calls `finish` once every tensor has landed: it checks that every
parameter was filled with finite values, then folds the norms of a model that defers them.

FP8 weights (`ember.quantization`) take more than a copy:

- From an FP8 checkpoint, a projection's weight lands as it is (float8 e4m3; another dtype is
  refused) and its ``weight_scale`` in the projection's row scales: a per-channel one directly,
  a per-tensor one through a one-value scratch that `finish` spreads over the rows it covers, so
  each shard of the fused q/k/v and gate/up keeps its own. A static ``input_scale`` is checked
  (finite, positive) and not used: activations are quantized per token. The KV-cache scales
  (`KV_SCALE_NAMES`) set their layer's ``Attention.k_scale`` / ``v_scale``.
- Quantized at load (``--quantization fp8``), a float weight lands in scratch of the model's
  dtype and `quantize_landed` quantizes it into the FP8 weight and its row scales once its bytes
  (and, where the model defers its norms, its norm's) have landed; the scratch is dropped then,
  so a loader that lands a layer at a time holds one layer's float weights at most. A
  tensor-parallel rank holds the columns of a row-parallel weight's rows (o, down, the experts'
  w2): its rows' scales are the whole rows' (their largest magnitudes taken over the ranks, one
  all-reduce per weight), so each rank's FP8 weights are the single-GPU model's columns.

Packed weights (gpt-oss's MXFP4 experts kept packed: uint8 blocks and scales) land as they are,
in their own dtype (another is refused).

A checkpoint tensor stored in another layout than its parameter's (gpt-oss's transposed,
interleaved or dequantized MXFP4 experts; Llama 4's transposed expert stacks quantized at load)
has a `TensorConversion` from its model: it lands in scratch of its own shape and dtype, and
`transform_landed` computes the parameter from it once every tensor the conversion reads has
landed, a layer at a time like the quantization above. A conversion into an FP8 weight fills
its row scales too.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ember.layers.fp8 import FP8_DTYPE, Fp8Weight, held_fp8_weights, quantize_rows_into
from ember.models.checkpoint_layout import layer_of
from ember.parallel.sharding import TensorSlice
from ember.weights.checkpoint import TensorHeader
from ember.weights.finite_check import first_non_finite

if TYPE_CHECKING:
    from ember.models.llama import LlamaForCausalLM

# A layer's KV-cache scales under the names FP8 checkpoints give them, and the `Attention`
# attributes each sets: compressed-tensors' (older versions: its k/v projections' output
# scales), and AutoFP8's one scale for both.
KV_SCALE_NAMES: dict[str, tuple[str, ...]] = {
    "self_attn.k_scale": ("k_scale",),
    "self_attn.v_scale": ("v_scale",),
    "self_attn.k_proj.output_scale": ("k_scale",),
    "self_attn.v_proj.output_scale": ("v_scale",),
    "self_attn.kv_scale": ("k_scale", "v_scale"),
}
# The shapes of one scale for a whole tensor.
SCALAR_SHAPES = frozenset({(), (1,)})
_INPUT_SCALE = ".input_scale"


@dataclass(frozen=True)
class _Quantization:
    """A float weight waiting in ``source`` to be quantized into ``weight`` and ``scale`` (rows
    of an FP8 projection), with the norm parameter that folds into it (None: none), and how its
    rows' largest magnitudes become the whole rows' (None: it holds whole rows)."""

    source: torch.Tensor
    weight: torch.Tensor
    scale: torch.Tensor
    norm: str | None
    whole_row_amax: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class TensorConversion:
    """How a parameter is computed from checkpoint tensors rather than copied from one:
    ``inputs`` (HF name, shape) land in scratch, then ``convert(target, *landed)`` fills the
    parameter named ``param`` from them (in ``inputs``' order). ``target``: the parameter, or
    for an FP8 weight its `Fp8Weight` (the weight and its row scales, both to fill)."""

    param: str
    inputs: tuple[tuple[str, tuple[int, ...]], ...]
    convert: Callable[..., None]


@dataclass
class _Landing:
    """A conversion's scratch, by HF name, as its inputs are handed out."""

    conversion: TensorConversion
    scratch: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.scratch) == len(self.conversion.inputs)


class WeightPlacer:
    """Maps checkpoint tensors (HF names) onto a model's fused parameters and checks, once all
    have been copied, that every parameter got its tensors and that they hold finite values.
    ``headers`` (by HF name) name each tensor's file in errors."""

    def __init__(self, model: LlamaForCausalLM, headers: Mapping[str, TensorHeader]) -> None:
        self._model = model
        self._headers = headers
        self._params = dict(model.named_parameters())
        # Each FP8 weight parameter's row scales (by parameter name), and the scales.
        names = {id(param): name for name, param in self._params.items()}
        self._scale_of = {
            names[id(weight.weight)]: names[id(weight.scale)] for weight in held_fp8_weights(model)
        }
        self._scales = frozenset(self._scale_of.values())
        scheme = model.cfg.fp8
        self._fp8_checkpoint = scheme is not None and scheme.from_checkpoint
        # Whether float weights are quantized as they load (call `quantize_landed`).
        self.quantizes = scheme is not None and not scheme.from_checkpoint
        # Whether some tensors are converted into their parameters once landed.
        self.converts = model.converts_tensors
        self._landings: dict[str, _Landing] = {}  # by parameter name
        self._float_dtype = model.embed_tokens.weight.dtype
        self._placed: set[str] = set()
        self._vocab_parallel = model.vocab_parallel_params
        self._targets: list[tuple[str, torch.Tensor]] = []  # (HF name, what it fills), in order
        self._pending: list[_Quantization] = []
        self._tensor_scales: list[tuple[torch.Tensor, torch.Tensor]] = []  # (value, its rows)
        self._scalars: list[tuple[str, torch.Tensor]] = []  # input and KV-cache scales

    def target(
        self, hf_name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None
    ) -> torch.Tensor | None:
        """The tensor ``hf_name`` (of ``shape`` and, if known, ``dtype``) is copied into: its
        parameter, a shard of a fused one, or scratch; None for a tensor the model does not use.
        ValueError for one it has no place for, or of the wrong shape or dtype."""
        model = self._model
        if self._fp8_checkpoint and _is_scalar(hf_name.removeprefix(model.checkpoint_prefix)):
            return self._scalar_target(hf_name, shape)
        conversion = model.tensor_conversion(hf_name) if self.converts else None
        if conversion is not None:
            return self._conversion_target(hf_name, shape, dtype, conversion)
        name, shard = model._param_name(hf_name)
        if name is None:
            return None
        if name not in self._params:
            raise ValueError(f"{self._describe(hf_name)} has no place in {model.cfg.architecture}")
        param = self._params[name]
        target = param.data if shard is None else model._shard_view(param.data, name, shard)
        if name in self._vocab_parallel and shape and shape[0] < target.shape[0]:
            target[shape[0] :].zero_()  # the last rank's padding rows: never looked up
            target = target[: shape[0]]
        self._placed.add(_key(name, shard))
        if name in self._scales:
            return self._scale_target(hf_name, target, shape)
        self._check_shape(hf_name, target, shape)
        if target.dtype == FP8_DTYPE and self.quantizes:
            return self._quantizing_target(hf_name, name, shard, target)
        if target.dtype == FP8_DTYPE and dtype is not None and dtype != FP8_DTYPE:
            raise ValueError(
                f"{self._describe(hf_name)} is stored as {_dtype_name(dtype)}, but the "
                "checkpoint's quantization_config makes its projections float8_e4m3fn"
            )
        if target.dtype != FP8_DTYPE and dtype == FP8_DTYPE:
            raise ValueError(  # its values without their scales would be wrong
                f"{self._describe(hf_name)} is stored as float8_e4m3fn, but the checkpoint's "
                "quantization_config leaves it unquantized"
            )
        if not target.is_floating_point() and dtype is not None and dtype != target.dtype:
            raise ValueError(  # packed bytes (MXFP4 blocks and scales) must land as they are
                f"{self._describe(hf_name)} is stored as {_dtype_name(dtype)}, expected "
                f"{_dtype_name(target.dtype)}"
            )
        self._targets.append((hf_name, target))
        return target

    def slice_of(self, hf_name: str, shape: tuple[int, ...]) -> TensorSlice | None:
        """The slice of checkpoint tensor ``hf_name`` (of ``shape``) a tensor-parallel rank
        reads, its target then asked for with the slice's shape; None: the whole tensor."""
        return self._model.tensor_slice(hf_name, tuple(shape))

    def load_group(self, hf_name: str) -> Hashable:
        """The group a loader that lands a group of tensors at a time puts ``hf_name`` in: its
        decoder layer (None: the shared tensors), so that a layer's float weights and its norms
        land together and `quantize_landed` quantizes them before the next layer arrives; a
        model may cut a layer finer (`load_group` of the model: a few experts at a time)."""
        return self._model.load_group(hf_name)

    @property
    def transforms(self) -> bool:
        """Whether landed tensors are quantized or converted: a loader then lands them a group
        at a time (`load_group`) and calls `transform_landed` after each."""
        return self.quantizes or self.converts

    def transform_landed(self) -> None:
        """Quantize and convert every tensor whose bytes (and those it waits for) have landed:
        call once every target handed out so far has been filled."""
        self.quantize_landed()
        self.convert_landed()

    def convert_landed(self) -> None:
        """Compute each parameter whose conversion's inputs have all landed; drop their scratch."""
        for name, landing in list(self._landings.items()):
            if not landing.complete:
                continue
            inputs = landing.conversion.inputs
            target = self._conversion_output(name)
            landing.conversion.convert(target, *(landing.scratch[hf] for hf, _ in inputs))
            # An FP8 weight's NaN or infinity makes its row's scale one too.
            checked = target.scale if isinstance(target, Fp8Weight) else target
            self._targets.append((inputs[0][0], checked))
            self._placed.add(name)
            del self._landings[name]

    def quantize_landed(self) -> None:
        """Quantize every weight waiting whose bytes have landed, and whose norm's have where one
        folds in: call once every target handed out so far has been filled."""
        waiting = []
        for item in self._pending:
            if item.norm is not None and item.norm not in self._placed:
                waiting.append(item)
                continue
            norm = None if item.norm is None else self._params[item.norm].data
            quantize_rows_into(item.source, item.weight, item.scale, norm, item.whole_row_amax)
        self._pending = waiting

    def finish(self) -> None:
        """Raise if a parameter was not filled or holds a NaN or an infinity; then set the KV
        cache's scales, put weights stored in another order in the ops' order
        (`arrange_loaded_weights`), and fold the norms if the model defers them (after the check:
        folding would hide a bad norm)."""
        self.convert_landed()
        waiting = next(iter(self._landings.values()), None)
        if waiting is not None:
            absent = [hf for hf, _ in waiting.conversion.inputs if hf not in waiting.scratch]
            raise ValueError(
                f"checkpoint lacks {absent[0]!r}, which {waiting.conversion.param} needs"
            )
        self._model._check_all_loaded(self._params, self._placed)
        self.quantize_landed()
        for value, rows in self._tensor_scales:
            rows.copy_(value.reshape(()).expand(rows.shape))
        checked = self._targets + self._scalars
        bad = first_non_finite(checked)
        if bad is not None:
            dtype = next(tensor.dtype for name, tensor in checked if name == bad)
            raise ValueError(
                f"{self._describe(bad)} holds NaN or infinite values (as {_dtype_name(dtype)}), "
                "which would make the logits NaN: the file is damaged, or its values do not fit "
                "that dtype"
            )
        self._set_scalars()
        self._model.arrange_loaded_weights()
        if self._model.defers_norms:
            self._model._fold_norm_weights()

    # -- conversions -------------------------------------------------------------------------------

    def _conversion_target(
        self,
        hf_name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype | None,
        conversion: TensorConversion,
    ) -> torch.Tensor:
        """Scratch of ``hf_name``'s shape and dtype (the model's where unknown) for a tensor
        ``conversion`` reads."""
        if conversion.param not in self._params:
            raise ValueError(
                f"{self._describe(hf_name)} has no place in {self._model.cfg.architecture}"
            )
        expected = dict(conversion.inputs)[hf_name]
        if tuple(shape) != tuple(expected):
            raise ValueError(
                f"{self._describe(hf_name)} has shape {tuple(shape)}, expected {tuple(expected)}"
            )
        landing = self._landings.setdefault(conversion.param, _Landing(conversion))
        device = self._params[conversion.param].device
        scratch = torch.empty(shape, dtype=dtype or self._float_dtype, device=device)
        landing.scratch[hf_name] = scratch
        return scratch

    def _conversion_output(self, name: str) -> torch.Tensor | Fp8Weight:
        """What a conversion into parameter ``name`` fills: the parameter, or an FP8 weight
        with its row scales (then placed too)."""
        param = self._params[name].data
        scale_name = self._scale_of.get(name)
        if scale_name is None:
            return param
        self._placed.add(scale_name)
        return Fp8Weight(param, self._params[scale_name].data)

    # -- FP8 ---------------------------------------------------------------------------------------

    def _scale_target(
        self, hf_name: str, rows: torch.Tensor, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """Where a projection's ``weight_scale`` lands: its rows' scales (per channel, ``[N, 1]``
        or ``[N]``), or one value spread over them at `finish` (per tensor)."""
        self._targets.append((hf_name, rows))
        if tuple(shape) in SCALAR_SHAPES:
            value = torch.empty(shape, dtype=torch.float32, device=rows.device)
            self._tensor_scales.append((value, rows))
            return value
        if tuple(shape) not in ((rows.shape[0], 1), (rows.shape[0],)):
            raise ValueError(
                f"{self._describe(hf_name)} has shape {tuple(shape)}, expected a scale per "
                f"tensor [] or [1], or per output channel [{rows.shape[0]}, 1]"
            )
        return rows.view(shape)

    def _quantizing_target(
        self, hf_name: str, name: str, shard: int | None, weight: torch.Tensor
    ) -> torch.Tensor:
        """Scratch for a float weight quantized once it (and its norm) has landed."""
        scale_name = self._scale_of[name]
        scale = self._params[scale_name].data
        if shard is not None:
            scale = self._model._shard_view(scale, scale_name, shard)
        self._placed.add(_key(scale_name, shard))
        # A NaN or an infinity in the weight makes its row's scale one too.
        self._targets.append((hf_name, scale))
        source = torch.empty(weight.shape, dtype=self._float_dtype, device=weight.device)
        norm = self._model.norm_folded_into(name)
        model = self._model
        whole_rows = model.parallel.all_reduce_max if model.is_row_parallel(name) else None
        self._pending.append(_Quantization(source, weight, scale, norm, whole_rows))
        return source

    def _scalar_target(self, hf_name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Scratch for a static input scale or a KV-cache scale, read at `finish`."""
        if tuple(shape) not in SCALAR_SHAPES:
            raise ValueError(f"{self._describe(hf_name)} has shape {tuple(shape)}, not [] or [1]")
        value = torch.empty(shape, dtype=torch.float32, device=self._model.norm.device)
        self._scalars.append((hf_name, value))
        return value

    def _set_scalars(self) -> None:
        """Check that every input and KV-cache scale is positive; set the KV cache's."""
        if not self._scalars:
            return
        values = torch.stack([value.reshape(()) for _, value in self._scalars]).tolist()
        prefix = self._model.checkpoint_prefix
        for (hf_name, _), value in zip(self._scalars, values, strict=True):
            if not value > 0:
                raise ValueError(f"{self._describe(hf_name)} is {value}; a scale must be positive")
            name = hf_name.removeprefix(prefix)  # model.layers.{i}.{layer_name}
            attention = self._model.layers[layer_of(name)].self_attn
            for attribute in KV_SCALE_NAMES.get(name.split(".", 3)[3], ()):
                setattr(attention, attribute, value)

    # -- errors ------------------------------------------------------------------------------------

    def _check_shape(self, hf_name: str, target: torch.Tensor, shape: tuple[int, ...]) -> None:
        if tuple(target.shape) != tuple(shape):
            raise ValueError(
                f"{self._describe(hf_name)} has shape {tuple(shape)}, "
                f"expected {tuple(target.shape)}"
            )

    def _describe(self, hf_name: str) -> str:
        header = self._headers.get(hf_name)
        return header.describe() if header is not None else f"checkpoint tensor {hf_name!r}"


def _is_scalar(name: str) -> bool:
    """Whether ``name`` (after the model's checkpoint prefix) is an FP8 checkpoint's input or
    KV-cache scale."""
    layer_name = name.split(".", 3)[-1]
    return name.endswith(_INPUT_SCALE) or layer_name in KV_SCALE_NAMES


def _key(name: str, shard: int | None) -> str:
    """How a filled parameter (or one shard of a fused one) is recorded."""
    return name if shard is None else f"{name}#{shard}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
