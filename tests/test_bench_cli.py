"""The benchmark commands that run without a GPU."""

from __future__ import annotations

import json

from ember import LLM, SamplingParams
from ember.bench import cpu_step
from ember.cli import main


def test_make_model_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "tiny"
    assert (
        main(["bench", "make-model", "--preset", "tiny", "--out", str(out), "--device", "cpu"]) == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "model.layers.3.mlp.down_proj.weight" in index["weight_map"]
    llm = LLM(str(out), max_model_len=128)
    tokens = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0]
    assert len(tokens.token_ids) == 4


def test_cpu_step_reports_every_phase():
    row = cpu_step.measure(batch=8, context=64, steps=5)
    assert row["batch"] == 8
    for key in ("schedule_ms", "stage_inputs_ms", "update_ms"):
        assert row[key] > 0
    assert (
        abs(row["total_ms"] - row["schedule_ms"] - row["stage_inputs_ms"] - row["update_ms"]) < 1e-9
    )


def test_step_bench_refuses_without_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        return
    assert main(["bench", "step", "--model", "unused"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
