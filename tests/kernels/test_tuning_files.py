"""`ember bench tune`'s tune.json read back into a model instance's kernel tables: the rows of a
file named by ``--kernel-tuning`` win over the heuristics, a file from another GPU is used with a
warning, a file that cannot be read is refused with its path, and every shipped table parses."""

from __future__ import annotations

import json
import logging
from importlib import resources

import pytest
import torch
from helpers.tiny_models import make_tiny_model

from ember import LLM
from ember.cli import build_parser, engine_options
from ember.kernels.moe_tiles import MeasuredMoeTiles, MoeShape, default_moe_tiles
from ember.kernels.tuning import KernelTuning
from ember.kernels.tuning_files import (
    SHIPPED_PACKAGE,
    TuningFileError,
    file_rows,
    measured_as_dict,
    merge_tune_into,
    merged_tunes,
    shipped_rows,
)

SHAPE = MoeShape(num_experts=32, hidden=2880, intermediate=2880, top_k=4)


def write_tune_json(path, rows, gpu="NVIDIA H200"):
    """A tune.json as `ember bench tune --sections moe` writes it (other keys trimmed)."""
    table = [measured_as_dict(row) for row in rows]
    path.write_text(json.dumps({"gpu": gpu, "moe": {"rows": [], "table": table}}))
    return path


def test_the_files_rows_replace_the_heuristics_up_to_their_token_bounds(tmp_path):
    # Tiles the heuristics never choose at these counts: a grouped path's at decode sizes.
    small, large = default_moe_tiles(SHAPE, 300), default_moe_tiles(SHAPE, 3000)
    path = write_tune_json(
        tmp_path / "tune.json",
        [MeasuredMoeTiles(SHAPE, 4, small), MeasuredMoeTiles(SHAPE, 64, large)],
    )
    moe = KernelTuning.for_device(torch.device("cpu"), str(path)).moe
    assert moe.tiles_for(SHAPE, 1) == moe.tiles_for(SHAPE, 4) == small
    assert moe.tiles_for(SHAPE, 5) == moe.tiles_for(SHAPE, 64) == large
    assert moe.tiles_for(SHAPE, 65) == default_moe_tiles(SHAPE, 65, moe)
    other = SHAPE._replace(mxfp4=True)  # its own rows: none measured
    assert moe.tiles_for(other, 1) == default_moe_tiles(other, 1, moe) != small
    assert KernelTuning.for_device(torch.device("cpu")).moe.measured == ()


def test_a_tune_merged_into_an_earlier_one_replaces_its_rows_and_keeps_the_others(tmp_path):
    """`bench tune --merge-into FILE`: a second call's rows for 64 tokens join the first's for
    1 and 256, its row for 256 replaces the first's, and the engine reads all three back; the
    file is created by a first merge; a tune of another GPU is refused."""
    small, large = default_moe_tiles(SHAPE, 300), default_moe_tiles(SHAPE, 3000)

    def tune(gpu, *rows):
        table = [measured_as_dict(row) for row in rows]
        measured = [{"shape": "s", "tokens": row.max_tokens, "us": 1.0} for row in rows]
        return {"gpu": gpu, "attention": [len(rows)], "moe": {"rows": measured, "table": table}}

    path = tmp_path / "h200.json"
    first = tune(
        "NVIDIA H200", MeasuredMoeTiles(SHAPE, 1, small), MeasuredMoeTiles(SHAPE, 256, small)
    )
    assert merge_tune_into(path, first) == first and json.loads(path.read_text()) == first
    second = tune(
        "NVIDIA H200", MeasuredMoeTiles(SHAPE, 256, large), MeasuredMoeTiles(SHAPE, 64, large)
    )
    merged = merge_tune_into(path, second)
    assert [r["max_tokens"] for r in merged["moe"]["table"]] == [1, 64, 256]
    assert [r["tokens"] for r in merged["moe"]["rows"]] == [1, 64, 256]
    assert merged["attention"] == [2]  # another section: the later run's
    assert json.loads(path.read_text()) == merged
    moe = KernelTuning.for_device(torch.device("cpu"), str(path)).moe
    assert moe.tiles_for(SHAPE, 1) == small
    assert moe.tiles_for(SHAPE, 64) == moe.tiles_for(SHAPE, 256) == large
    with pytest.raises(TuningFileError, match="NVIDIA H100"):
        merged_tunes(merged, tune("NVIDIA H100", MeasuredMoeTiles(SHAPE, 1, large)))


def test_a_file_from_another_gpu_is_used_with_a_warning(tmp_path, caplog):
    row = MeasuredMoeTiles(SHAPE, 8, default_moe_tiles(SHAPE, 300))
    path = write_tune_json(tmp_path / "tune.json", [row], gpu="NVIDIA H100 80GB HBM3")
    with caplog.at_level(logging.WARNING, logger="ember.kernels.tuning_files"):
        assert file_rows(path, "NVIDIA H200") == (row,)
    assert "measured on NVIDIA H100 80GB HBM3, not this NVIDIA H200" in caplog.text


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "No such file"),
        ("{not json", "not JSON"),
        ("[1, 2]", "not a tune.json"),
        (json.dumps({"gpu": "x", "gemm": {"rows": []}}), "has no moe table"),
        (json.dumps({"gpu": "x", "moe": {"table": [{"shape": {}}]}}), "row is malformed"),
    ],
)
def test_an_unreadable_file_is_refused_with_its_path(tmp_path, content, message):
    path = tmp_path / "tune.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TuningFileError, match=message) as error:
        KernelTuning.for_device(torch.device("cpu"), str(path))
    assert str(path) in str(error.value)


def test_every_shipped_table_parses_and_names_its_gpu():
    shipped = [e for e in resources.files(SHIPPED_PACKAGE).iterdir() if e.name.endswith(".json")]
    for entry in shipped:
        gpu = json.loads(entry.read_text())["gpu"]
        assert gpu.startswith("NVIDIA ") and shipped_rows(gpu)
    assert shipped_rows("a GPU no table was measured on") == ()


def test_serve_passes_the_file_to_the_model_instance(tmp_path):
    row = MeasuredMoeTiles(SHAPE, 8, default_moe_tiles(SHAPE, 300))
    path = write_tune_json(tmp_path / "tune.json", [row])
    args = build_parser().parse_args(["serve", "m", "--kernel-tuning", str(path)])
    assert engine_options(args)["kernel_tuning"] == str(path)
    model = make_tiny_model("LlamaForCausalLM", tmp_path / "llama")
    llm = LLM(str(model), device="cpu", max_model_len=32, kernel_tuning=str(path))
    assert llm.instance.tuning.moe.measured == (row,)
    with pytest.raises(TuningFileError, match="has no moe table"):
        LLM(str(model), device="cpu", max_model_len=32, kernel_tuning=str(model / "config.json"))
