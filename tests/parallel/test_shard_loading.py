"""Each tensor-parallel rank reads its slices of a safetensors checkpoint and nothing else: the
ranks' parameters are the slices of the whole tensors, and their reads add up to the file's
bytes once (plus the small tensors every rank holds whole). Loading needs no collective, so a
rank's shard is built here with the ranks' shapes alone (`ShapeGroup`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers.fp8_checkpoints import fp8_checkpoint
from helpers.shard_loads import CPU, checkpoint_tensors, load_rank
from helpers.tiny_models import make_tiny_model

from ember.weights.parallel_load import SPAN_READ_RUN_BYTES, load_extents
from ember.weights.safetensors_layout import read_extents, slice_extent


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny Llama over several files, its vocabulary not a multiple of two."""
    return make_tiny_model(
        "LlamaForCausalLM",
        tmp_path_factory.mktemp("tp") / "m",
        max_shard_size="2MB",
        vocab_size=49155,
    )


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_holds_the_slices_of_the_whole_tensors(checkpoint, rank):
    whole = checkpoint_tensors(checkpoint)
    model, _ = load_rank(checkpoint, rank, 2)
    params = dict(model.named_parameters())
    layer = "model.layers.1."
    q, k, v = (whole[f"{layer}self_attn.{p}_proj.weight"] for p in "qkv")
    half = lambda t: t.chunk(2)[rank]
    assert torch.equal(
        params["layers.1.self_attn.qkv_proj.weight"], torch.cat([half(q), half(k), half(v)])
    )
    o = whole[f"{layer}self_attn.o_proj.weight"]
    assert torch.equal(params["layers.1.self_attn.o_proj.weight"], o.chunk(2, dim=1)[rank])
    gate, up = whole[f"{layer}mlp.gate_proj.weight"], whole[f"{layer}mlp.up_proj.weight"]
    assert torch.equal(
        params["layers.1.mlp.gate_up_proj.weight"], torch.cat([half(gate), half(up)])
    )
    down = whole[f"{layer}mlp.down_proj.weight"]
    assert torch.equal(params["layers.1.mlp.down_proj.weight"], down.chunk(2, dim=1)[rank])
    assert torch.equal(params["layers.1.input_layernorm"], whole[f"{layer}input_layernorm.weight"])
    # 49155 ids: 24578 rows each, the last rank's last one padding (zero).
    for name, hf in (
        ("embed_tokens.weight", "model.embed_tokens.weight"),
        ("lm_head", "lm_head.weight"),
    ):
        rows = whole[hf][rank * 24578 : (rank + 1) * 24578]
        assert params[name].shape[0] == 24578
        assert torch.equal(params[name][: len(rows)], rows)
        assert not params[name][len(rows) :].any()


def test_the_ranks_read_each_byte_once(checkpoint):
    """Summed over the ranks, the reads are the file's tensor bytes plus, for each rank past
    the first, the tensors every rank holds whole (norms); with fewer KV heads than ranks
    (2 of 4) each k and v row is read by the ranks that share it. Nothing else twice."""
    whole = checkpoint_tensors(checkpoint)
    nbytes = lambda t: t.numel() * t.element_size()
    total = sum(nbytes(t) for t in whole.values())
    norms = sum(nbytes(t) for name, t in whole.items() if "norm" in name)
    kv = sum(
        nbytes(t) for name, t in whole.items() if name.endswith(("k_proj.weight", "v_proj.weight"))
    )
    for size, kv_copies in ((2, 1), (4, 2)):
        reads = [load_rank(checkpoint, rank, size)[1] for rank in range(size)]
        assert sum(reads) == total + (size - 1) * norms + (kv_copies - 1) * kv
        assert max(reads) <= math.ceil(total / size) + norms + kv


@pytest.mark.parametrize(
    ("columns", "start", "width"),
    [(10, 3, 4), (2 * SPAN_READ_RUN_BYTES // 4, 5, SPAN_READ_RUN_BYTES // 4)],
    ids=["short-runs-read-as-spans", "page-long-runs-read-one-by-one"],
)
def test_a_slice_of_columns_reads_only_its_rows_segments(tmp_path, columns, start, width):
    """The row-parallel read: a matrix's columns [start, start + width), one run per row (runs
    shorter than a page read a chunk's span at a time and gathered), two rows a chunk."""
    from safetensors.torch import save_file

    matrix = torch.arange(5 * columns, dtype=torch.float32).view(5, columns)
    save_file({"w": matrix, "tail": torch.ones(3)}, str(tmp_path / "t.safetensors"))
    (extent,) = [e for e in read_extents(tmp_path / "t.safetensors") if e.name == "w"]
    part = slice_extent(extent, 1, start, width)
    target = torch.zeros(5, width)
    read = load_extents([part], lambda e: target, CPU, chunk_bytes=2 * columns * 4)
    assert read == 5 * width * 4
    assert torch.equal(target, matrix[:, start : start + width])
    rows = slice_extent(extent, 0, 1, 2)
    target = torch.zeros(2, columns)
    assert load_extents([rows], lambda e: target, CPU) == 2 * columns * 4
    assert torch.equal(target, matrix[1:3])


def test_a_slice_of_stacked_experts_reads_only_its_runs(tmp_path):
    """Stacked experts [E, 2I, H]: each expert's gate rows [1, 3) and up rows [5, 7) (two runs
    an expert); [E, H, I]: each expert row's columns [2, 4), one run each. A chunk holds whole
    runs (here two an expert)."""
    from safetensors.torch import save_file

    stacked = torch.arange(3 * 8 * 5, dtype=torch.float32).view(3, 8, 5)
    save_file({"w13": stacked, "w2": stacked.clone()}, str(tmp_path / "t.safetensors"))
    extents = {e.name: e for e in read_extents(tmp_path / "t.safetensors")}
    part = slice_extent(extents["w13"], 1, 1, 2, parts=2)
    assert part.shape == (3, 4, 5) and part.nbytes == 3 * 4 * 5 * 4
    target = torch.zeros(part.shape)
    assert load_extents([part], lambda e: target, CPU, chunk_bytes=80) == part.nbytes
    assert torch.equal(target, stacked[:, [1, 2, 5, 6]])
    columns = slice_extent(extents["w2"], 2, 2, 2)
    target = torch.zeros(3, 8, 2)
    assert load_extents([columns], lambda e: target, CPU, chunk_bytes=24) == 3 * 8 * 2 * 4
    assert torch.equal(target, stacked[:, :, 2:4])
    with pytest.raises(ValueError, match="cannot take"):
        slice_extent(extents["w2"], 1, 0, 5, parts=2)  # 8 rows: two parts of 4


@pytest.mark.parametrize("layout", ["compressed-tensors", "fp8"])
def test_fp8_weights_shard_with_their_scales(tmp_path, layout):
    """A per-channel scale is cut with its weight's rows (whole on the row-parallel side); a
    per-tensor one spreads over the rows each rank holds."""
    source = make_tiny_model("LlamaForCausalLM", tmp_path / "m", num_hidden_layers=1)
    path = fp8_checkpoint(source, tmp_path / layout, layout)
    whole_model, _ = load_rank(path, 0, 1)
    whole = dict(whole_model.named_parameters())
    cfg = whole_model.cfg
    sizes = {
        "mlp.gate_up_proj": [cfg.intermediate_size] * 2,
        "self_attn.qkv_proj": [cfg.q_size, cfg.kv_size, cfg.kv_size],
    }
    for rank in (0, 1):
        params = dict(load_rank(path, rank, 2)[0].named_parameters())
        for name, parts in sizes.items():
            for kind in ("weight", "weight_scale"):
                full = whole[f"layers.0.{name}.{kind}"]
                full = full.view(torch.uint8) if kind == "weight" else full
                expected = torch.cat([part.chunk(2)[rank] for part in full.split(parts)])
                got = params[f"layers.0.{name}.{kind}"]
                assert torch.equal(got.view(torch.uint8) if kind == "weight" else got, expected)
        down = "layers.0.mlp.down_proj"
        assert torch.equal(
            params[f"{down}.weight"].view(torch.uint8),
            whole[f"{down}.weight"].view(torch.uint8).chunk(2, dim=1)[rank],
        )
        assert torch.equal(params[f"{down}.weight_scale"], whole[f"{down}.weight_scale"])
