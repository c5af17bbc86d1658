"""How the fused MoE kernels launch for a shape and a token count, decided without Triton.

`MoeTuning` is one GPU's table (held in the device's `KernelTuning`, so two models of different
shapes in one process each look up their own rows): tiles that `ember bench tune --sections moe`
measured per `MoeShape` and token count, and heuristics where it measured nothing. A launch's
`MoeTiles` say which of the two paths runs (`ember.kernels.fused_moe`):

- by pair (decode): one program per (pair, column tile) for gate/up and per (token, column
  tile) for down, which sums the token's k experts itself (two launches), or, where a token's
  column tiles are too few to fill the GPU, per (pair, column tile) and a sum over k: no
  alignment, and each program streams one expert's weight rows, as a decode GEMV does;
- grouped: pairs aligned into blocks of ``block_m`` rows of one expert (`ember.kernels.moe_align`),
  one grouped GEMM for gate/up with the activation fused, one for down with the routing weights
  applied, and a sum over k.

Importable without Triton (the CPU path and the tests read the tables).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

from ember.kernels.tiles import SHARED_MEMORY_BUDGET, shrink_to_fit

# `tl.dot`'s fewest rows: a by-pair program's one row is padded to it.
MIN_DOT_ROWS = 16
# MXFP4 weights: two values a byte and one scale byte a group of 32 values along K, which a
# tile's BLOCK_K must hold whole.
MXFP4_GROUP = 32
MXFP4_BYTES_PER_ELEMENT = 0.5 + 1 / MXFP4_GROUP
# Weight values a GEMV thread takes a K step, at the least, where a tile has enough.
GEMV_MIN_VALUES_PER_THREAD = 32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class MoeShape(NamedTuple):
    """A MoE layer's experts: ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, ``top_k`` experts a token,
    activations of ``elem_bytes`` an element; ``mxfp4``: the weights packed in MXFP4, ``fp8``:
    float8 e4m3 with row scales (each its own rows of the table; until a tune measures FP8's,
    the heuristics give it the tiles of the activations' dtype)."""

    num_experts: int
    hidden: int
    intermediate: int
    top_k: int
    elem_bytes: int = 2
    mxfp4: bool = False
    fp8: bool = False

    @property
    def weight_bytes(self) -> float:
        """Bytes a weight element takes in memory: MXFP4's half a byte and its scale's 1/32,
        FP8's one, else the activations' size."""
        if self.mxfp4:
            return MXFP4_BYTES_PER_ELEMENT
        return 1 if self.fp8 else self.elem_bytes


@dataclass(frozen=True)
class GemmTiles:
    """One of the two products' tiles. ``block_n``: output columns a program stores (for
    gate/up, columns of each half: it reads ``2 * block_n`` weight rows); ``group_m``: grouped
    path only, row blocks that sweep the column tiles together (their weight tiles shared in
    L2); ``mxfp4_in_registers``: how a tensor-core product decodes MXFP4 weights."""

    block_n: int
    block_k: int
    stages: int
    num_warps: int
    group_m: int = 1
    # MXFP4 weights on bf16 activations, compiled: decode each tile in registers, in PTX
    # (`ember.kernels.mxfp4.mxfp4_tile_k_major`), rather than through `tl.dot_scaled`'s upcast.
    mxfp4_in_registers: bool = False

    def name(self) -> str:
        name = f"n{self.block_n}_k{self.block_k}_s{self.stages}_w{self.num_warps}_g{self.group_m}"
        return name + "_regs" if self.mxfp4_in_registers else name


@dataclass(frozen=True)
class MoeTiles:
    """A launch of the fused MoE: the path (``by_pair``), the rows of an aligned block
    (grouped path; by pair, `MIN_DOT_ROWS`) and each product's tiles. By pair, down runs one
    program per token and column tile summing its k experts (``down_by_token``), or one per
    pair and column tile and a sum over k after (more programs, one more launch). ``gemv``
    (by pair, down by token): the products on the CUDA cores (`ember.kernels.moe_gemv`), one
    row a program and no `tl.dot`, so no padding to 16 rows and no tensor-core decode of
    MXFP4 tiles; its column tiles may be narrower than 16."""

    by_pair: bool
    block_m: int
    gate_up: GemmTiles
    down: GemmTiles
    down_by_token: bool = True
    gemv: bool = False

    def __post_init__(self) -> None:
        if self.gemv and not (self.by_pair and self.down_by_token):
            raise ValueError("the GEMV products run by pair with down by token")

    def as_dict(self) -> dict:
        return {
            "by_pair": self.by_pair,
            "block_m": self.block_m,
            "gate_up": vars(self.gate_up).copy(),
            "down": vars(self.down).copy(),
            "down_by_token": self.down_by_token,
            "gemv": self.gemv,
        }

    @classmethod
    def from_dict(cls, d: dict) -> MoeTiles:
        return cls(
            d["by_pair"],
            d["block_m"],
            GemmTiles(**d["gate_up"]),
            GemmTiles(**d["down"]),
            d.get("down_by_token", True),
            d.get("gemv", False),
        )


class MeasuredMoeTiles(NamedTuple):
    """A row of the table: the tiles for ``shape`` at up to ``max_tokens`` tokens (the rows of
    one shape are read in increasing ``max_tokens``; the first that covers a count wins)."""

    shape: MoeShape
    max_tokens: int
    tiles: MoeTiles


@dataclass(frozen=True)
class MoeTuning:
    """One GPU's MoE table; the defaults are heuristics, replaced by ``measured`` rows from
    `ember bench tune --sections moe` where a shape has them."""

    num_sms: int = 132
    # Up to this many tokens the by-pair path runs: each pair's expert rows are streamed by
    # their own programs, so tokens sharing an expert read it again (from L2 when they run
    # together); past it the grouped path reads each chosen expert once.
    by_pair_max_tokens: int = 4
    # Pairs (tokens x k) up to which the one-program alignment kernel runs; past it torch's
    # stable sort (more launches, but parallel). Both are capturable.
    align_kernel_max_pairs: int = 2048
    shared_memory_budget: int = SHARED_MEMORY_BUDGET
    # FP8 experts' tiles widen to bf16 in PTX (`ember.kernels.fp8_widen`), as the dense FP8
    # products do (`LinearRoutes.fp8_widen_in_registers`; `--no-fp8-widen-in-registers`).
    fp8_widen_in_registers: bool = True
    measured: tuple[MeasuredMoeTiles, ...] = field(default=())

    def tiles_for(self, shape: MoeShape, tokens: int) -> MoeTiles:
        """The measured tiles for ``shape`` at ``tokens``, else `default_moe_tiles`."""
        rows = sorted((r for r in self.measured if r.shape == shape), key=lambda r: r.max_tokens)
        for row in rows:
            if tokens <= row.max_tokens:
                return row.tiles
        return default_moe_tiles(shape, tokens, self)

    def with_measured(self, *rows: MeasuredMoeTiles) -> MoeTuning:
        """This table with ``rows`` added (ahead of any earlier row of the same shape and
        token bound)."""
        keys = {(r.shape, r.max_tokens) for r in rows}
        kept = tuple(r for r in self.measured if (r.shape, r.max_tokens) not in keys)
        return replace(self, measured=kept + tuple(rows))


def default_moe_tiles(shape: MoeShape, tokens: int, tuning: MoeTuning | None = None) -> MoeTiles:
    """Heuristic tiles. Decode-sized launches are weight streams: column tiles narrow enough
    that the programs reading the chosen experts fill the GPU twice over, long K steps in
    several stages, in half an SM's shared memory (two programs an SM keep loads in flight
    across a program's tail). Larger ones are compute-bound grouped GEMMs on tensor-core
    tiles, with ``group_m`` row blocks sharing each weight tile."""
    tuning = tuning or MoeTuning()
    pairs = tokens * shape.top_k
    budget = tuning.shared_memory_budget
    mxfp4 = shape.mxfp4
    fit_bytes = _fit_bytes(shape)
    if tokens <= tuning.by_pair_max_tokens:
        # MXFP4 decode on the CUDA cores: no tensor-core decode of whole tiles for one row.
        return by_pair_moe_tiles(shape, tokens, tuning, gemv=mxfp4)
    rows_per_expert = pairs / shape.num_experts
    block_m = next((m for m in (16, 32, 64) if rows_per_expert <= m * 1.5), 128)
    if block_m == 16:  # one or two tokens an expert: still a weight stream
        blocks = min(pairs, shape.num_experts)
        gate_up = _stream_tiles(shape.intermediate, shape.hidden, blocks, tuning.num_sms, mxfp4)
        down = _stream_tiles(shape.hidden, shape.intermediate, blocks, tuning.num_sms, mxfp4)
        tiles = MoeTiles(False, block_m, gate_up, down)
        return fit_shared_memory(tiles, shape.elem_bytes, budget // 2, fit_bytes)
    warps = 4 if block_m <= 32 else 8
    gate_up = GemmTiles(64, 64, 4, warps, group_m=8)
    down = GemmTiles(128 if block_m >= 64 else 64, 64, 4, warps, group_m=8)
    tiles = MoeTiles(False, block_m, gate_up, down)
    return fit_shared_memory(tiles, shape.elem_bytes, budget, fit_bytes)


def by_pair_moe_tiles(
    shape: MoeShape, tokens: int, tuning: MoeTuning | None = None, gemv: bool = False
) -> MoeTiles:
    """Heuristic tiles of the by-pair path, on `tl.dot` or (``gemv``) on the CUDA cores
    (`gemv_moe_tiles`), in half an SM's shared memory. On `tl.dot`: weight streams per pair
    for gate/up, and down by token while the tokens' column tiles fill the GPU twice, else by
    pair."""
    tuning = tuning or MoeTuning()
    if gemv:
        tiles = gemv_moe_tiles(shape, tokens, tuning)
    else:
        pairs = tokens * shape.top_k
        down_by_token = tokens * cdiv(shape.hidden, 16) >= 2 * tuning.num_sms
        down_programs = tokens if down_by_token else pairs
        sms, mxfp4 = tuning.num_sms, shape.mxfp4
        tiles = MoeTiles(
            by_pair=True,
            block_m=MIN_DOT_ROWS,
            gate_up=_stream_tiles(shape.intermediate, shape.hidden, pairs, sms, mxfp4),
            down=_stream_tiles(shape.hidden, shape.intermediate, down_programs, sms, mxfp4),
            down_by_token=down_by_token,
        )
    budget = tuning.shared_memory_budget // 2
    return fit_shared_memory(tiles, shape.elem_bytes, budget, _fit_bytes(shape))


def _fit_bytes(shape: MoeShape) -> float:
    """A weight element's bytes in the shared-memory fit: FP8 experts keep the tiles of the
    activations' dtype (fitted as if their weights took its bytes) until `ember bench tune
    --sections moe` measures theirs."""
    return shape.elem_bytes if shape.fp8 else shape.weight_bytes


def gemv_moe_tiles(shape: MoeShape, tokens: int, tuning: MoeTuning | None = None) -> MoeTiles:
    """Heuristic tiles of the by-pair path on the CUDA cores (``MoeTiles.gemv``): column tiles
    narrow enough that the programs fill the GPU four times over (a GEMV program keeps fewer
    loads in flight than a pipelined `tl.dot` one), K steps of 256 values, and up to four warps
    while each thread still takes `GEMV_MIN_VALUES_PER_THREAD` values a step (fewer spend more
    instructions a value on the step's addressing and sums: `ember bench isa`, MXFP4 down at
    4 columns 14.0 with four warps, 10.6 with one). MXFP4 experts: `_mxfp4_gemv_tiles`."""
    tuning = tuning or MoeTuning()
    if shape.mxfp4:
        return _mxfp4_gemv_tiles(shape, tokens, tuning)
    pairs = tokens * shape.top_k

    def stream(cols: int, row_programs: int) -> GemmTiles:
        block_n = 32
        while block_n > 2 and row_programs * cdiv(cols, block_n) < 4 * tuning.num_sms:
            block_n //= 2
        block_k = min(256, max(MXFP4_GROUP, next_power_of_2(shape.hidden)))
        return _gemv_gemm(block_n, block_k, stages=2)

    gate_up = stream(shape.intermediate, pairs)
    return MoeTiles(True, MIN_DOT_ROWS, gate_up, stream(shape.hidden, tokens), gemv=True)


def _mxfp4_gemv_tiles(shape: MoeShape, tokens: int, tuning: MoeTuning) -> MoeTiles:
    """The GEMV over MXFP4 experts: 8-column tiles, K steps of 256 values in one stage on two
    warps (32 values a thread); down takes K steps of 512 in two stages on four warps while its
    programs fill fewer than four waves: the tiles an H100's and an H200's tunes both measured
    fastest at 1 and 4 tokens of gpt-oss, well ahead of the general GEMV tiles and `tl.dot`'s
    (bench/results/README.md, "Fused MoE tables")."""

    def tiles(k: int, longest: int, stages: int) -> GemmTiles:
        return _gemv_gemm(8, min(longest, max(MXFP4_GROUP, next_power_of_2(k))), stages)

    few_down_programs = tokens * cdiv(shape.hidden, 8) < 4 * tuning.num_sms
    down = (
        tiles(shape.intermediate, 512, 2)
        if few_down_programs
        else tiles(shape.intermediate, 256, 1)
    )
    return MoeTiles(True, MIN_DOT_ROWS, tiles(shape.hidden, 256, 1), down, gemv=True)


def _gemv_gemm(block_n: int, block_k: int, stages: int) -> GemmTiles:
    """A GEMV product's tiles: up to four warps while each thread still takes
    `GEMV_MIN_VALUES_PER_THREAD` values a K step."""
    threads = block_n * block_k // GEMV_MIN_VALUES_PER_THREAD
    return GemmTiles(block_n, block_k, stages=stages, num_warps=max(1, min(4, threads // 32)))


def _stream_tiles(cols: int, k: int, row_programs: int, num_sms: int, mxfp4: bool) -> GemmTiles:
    """Tiles of a weight stream over ``cols`` output columns by ``row_programs`` programs a
    column tile: the widest of 64, 32, 16 columns whose programs fill two waves. ``mxfp4``
    weights take 64 columns however few programs that makes, in K steps of 128 (whole scale
    groups): their products are bound by decoding the weights, which narrower tiles repeat
    across a program's threads (`ember bench isa`: 8.5 instructions a value at 64 columns,
    13.8 at 32, 29 at 16), and `bench tune` found 64 columns and K steps of 128 fastest."""
    block_n = 64
    narrowest = 64 if mxfp4 else 16
    while block_n > narrowest and row_programs * cdiv(cols, block_n) < 2 * num_sms:
        block_n //= 2
    longest = 128 if mxfp4 or k < 2048 else 256
    block_k = min(longest, max(16, next_power_of_2(k)))
    return GemmTiles(block_n, block_k, stages=4, num_warps=4)


def shared_memory_estimate(
    rows: int, tiles: GemmTiles, elem_bytes: int, gated: bool, weight_bytes: float | None = None
) -> int:
    """Bytes of the pipelined x and weight tiles (two weight tiles when ``gated``), what Triton
    stages in shared memory; ``weight_bytes``: a weight element's (None: ``elem_bytes``)."""
    weight_rows = tiles.block_n * (2 if gated else 1)
    weight = elem_bytes if weight_bytes is None else weight_bytes
    return int((rows * elem_bytes + weight_rows * weight) * tiles.block_k * tiles.stages)


def fit_shared_memory(
    tiles: MoeTiles,
    elem_bytes: int,
    budget: int = SHARED_MEMORY_BUDGET,
    weight_bytes: float | None = None,
) -> MoeTiles:
    """Halve BLOCK_K (to 32), then drop stages (to 2), until each product's tiles fit (a GEMV
    program stages one activation row, not a block of them)."""
    rows = 1 if tiles.gemv else tiles.block_m

    def fit(gemm: GemmTiles, gated: bool) -> GemmTiles:
        config = shrink_to_fit(
            {"block_k": gemm.block_k, "stages": gemm.stages},
            lambda c: shared_memory_estimate(
                rows, replace(gemm, **c), elem_bytes, gated, weight_bytes
            ),
            [("block_k", 32, True), ("stages", 2, False)],
            budget,
        )
        return replace(gemm, **config)

    return replace(tiles, gate_up=fit(tiles.gate_up, True), down=fit(tiles.down, False))
