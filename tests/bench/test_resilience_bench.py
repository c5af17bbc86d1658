"""`ember bench resilience` end to end on the CPU with the default model: every phase runs and
reports, no KV block stays held after clients hang up, and a killed engine is replaced."""

from __future__ import annotations

import argparse
import json

import pytest

from ember.bench import resilience

pytestmark = pytest.mark.slow


def test_every_phase_reports_and_the_server_recovers(tmp_path):
    parser = argparse.ArgumentParser()
    resilience.add_arguments(parser)
    output = tmp_path / "resilience.json"
    args = parser.parse_args(
        [
            "--dataset",
            "random",
            "--num-prompts",
            "6",
            "--input-len",
            "24",
            "--output-len",
            "12",
            "--max-concurrency",
            "3",
            "--disconnect-streams",
            "12",
            "--disconnect-fraction",
            "0.7",
            "--kill-after",
            "0.5",
            "--server-args",
            "--max-model-len 256",
            "--output-json",
            str(output),
        ]
    )
    assert resilience.run(args) == 0
    report = json.loads(output.read_text())
    assert report["baseline"]["completed"] == 6 and report["again"]["completed"] == 6
    disconnects = report["disconnects"]
    assert disconnects["dropped_by_client"] + disconnects["completed"] == 12
    assert disconnects["failed"] == 0 and disconnects["kv_blocks_held_when_idle"] == 0
    kill = report["engine_kill"]
    assert kill["seconds_to_healthy"] is not None and kill["seconds_to_first_served_request"]
