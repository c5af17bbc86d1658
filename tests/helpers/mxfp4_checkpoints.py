"""A tiny gpt-oss checkpoint with its experts in MXFP4, as OpenAI publishes gpt-oss: each
layer's ``gate_up_proj`` and ``down_proj`` as blocks and scales (`ember.bench.make_model`'s
conversion), ``quant_method: mxfp4`` in config.json; everything else as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from ember.bench.make_model import GPT_OSS_MXFP4, mxfp4_experts

WEIGHTS = "model.safetensors"
_EXPERT_WEIGHTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def mxfp4_checkpoint(source: Path, out: Path) -> Path:
    """``source`` (a tiny gpt-oss directory, one weight file) copied to ``out`` with its
    experts' weights in MXFP4."""
    shutil.copytree(source, out)
    written = {}
    for name, tensor in load_file(str(source / WEIGHTS)).items():
        written.update(
            mxfp4_experts(name, tensor) if name.endswith(_EXPERT_WEIGHTS) else {name: tensor}
        )
    save_file(written, str(out / WEIGHTS), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = GPT_OSS_MXFP4
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
