"""`ember bench startup`: the phases it reads from the engine's timeline, and a whole run of its
four scenarios on the CPU (the store one against a real S3-compatible server)."""

from __future__ import annotations

import argparse
import json
import os

import pytest
from helpers.s3_server import S3Server
from helpers.tiny_models import make_tiny_model

from ember.bench import startup
from ember.engine.engine_core import STARTUP_TIMELINE_TAG


def test_phases_follow_the_engine_timeline():
    started = 100.0
    timeline = {
        "engine_process_started": 100.5,
        "engine_imported": 102.0,
        "cuda_init_started": 102.0,
        "cuda_initialised": 102.6,
        "models_planned": 102.3,
        "downloads": {"m": {"started_at": 102.1, "finished_at": 104.0}},
        "loads": {
            "m": {
                "started_at": 102.7,
                "seconds": 3.0,
                "setup_seconds": 0.5,
                "weight_load_seconds": 1.5,
                "kernel_compile_seconds": 1.0,
                "graph_capture_seconds": 0.4,
            }
        },
    }
    log = f"INFO something\n2026 engine INFO {STARTUP_TIMELINE_TAG} {json.dumps(timeline)}\n"
    phases = {
        name: (start, end)
        for name, start, end in startup.phases_of(startup.read_timeline(log), started)
    }
    assert phases["engine imports"] == pytest.approx((0.5, 2.0))
    assert phases["CUDA init"] == pytest.approx((2.0, 2.6))
    assert phases["download m"] == pytest.approx((2.1, 4.0))
    assert phases["setup m"] == pytest.approx((2.7, 3.2))
    assert phases["weights m"] == pytest.approx((3.2, 4.7))
    assert phases["compile m"] == pytest.approx((3.2, 4.2))  # beside the weights
    assert phases["graph capture m"] == pytest.approx((5.3, 5.7))
    assert startup.read_timeline("no timeline here") == {}


@pytest.mark.slow
def test_every_scenario_runs_and_reports_its_phases(tmp_path, monkeypatch):
    model = make_tiny_model("LlamaForCausalLM", tmp_path / "tiny", seed=2)
    output = tmp_path / "startup.json"
    with S3Server() as s3:
        s3.create_bucket("models")
        for name, value in s3.environ.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        parser = argparse.ArgumentParser()
        startup.add_arguments(parser)
        args = parser.parse_args(
            [
                str(model),
                "--s3-url",
                "s3://models/tiny",
                "--upload",
                "--server-args",
                "--device cpu --max-model-len 64",
                "--output-json",
                str(output),
                "--startup-timeout",
                "300",
            ]
        )
        assert startup.run(args) == 0
    report = json.loads(output.read_text())
    assert set(report["scenarios"]) == set(startup.SCENARIOS)
    for name, result in report["scenarios"].items():
        assert "error" not in result, (name, result)
        moments = result["moments_s"]
        assert 0 < moments["front_end_answered"] <= moments["healthy"] <= result["first_token_s"]
        phases = [phase for phase, _, _ in result["phases"]]
        assert "engine imports" in phases and any(p.startswith("weights") for p in phases)
    assert any(p[0].startswith("download") for p in report["scenarios"]["store"]["phases"])
    assert report["scenarios"]["store"]["store_download_floor_s"] > 0
    floors = report["floors"]
    assert floors["import_torch_s"] > 0 and floors["disk_read_s"] > 0
    assert floors["download_s"] > 0
    assert output.with_suffix(".png").stat().st_size > 0
