"""The front-end process (tokenizers, chat templates, HTTP) never imports torch: only the engine
process needs it, and importing it costs the front end ~1.5 s and ~300 MB."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

# What `ember serve` does in its own process before the engine process takes over: parse the
# flags, open the default model's checkpoint and build its tokenizer, build the app (whose
# lifespan spawns the engine through `ember.engine.launch`).
_FRONTEND_STARTUP = textwrap.dedent(
    """
    import sys

    import ember.cli
    import ember.engine.launch
    import ember.server.app
    import ember.server.serve
    from ember.server.app import build_app
    from ember.server.models import load_served_model
    from ember.weights.resolve import open_checkpoint
    from ember.tokenizer.tokenizer import Tokenizer

    args = ember.cli.build_parser().parse_args(["serve", "--max-model-len", "1024"])
    config = ember.cli.server_config(args)
    models = [load_served_model(spec) for spec in config.models]
    assert models[0].tokenizer.encode("Hello")  # the tokenizer is really usable
    build_app(config, models)

    checkpoint = open_checkpoint(None)  # the same, by hand: checkpoint, then tokenizer
    try:
        tokenizer = Tokenizer.from_checkpoint(checkpoint)
        assert tokenizer.encode("Hello")
    finally:
        checkpoint.close()

    imported = sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))
    print("torch modules:", imported[:5])
    assert not imported, imported
    """
)


def test_frontend_never_imports_torch():
    result = subprocess.run(
        [sys.executable, "-c", _FRONTEND_STARTUP],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _maps_torch(pid: int) -> bool:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return "libtorch" in maps or "/torch/" in maps


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid:  # the field after the state is the parent's pid
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_running_frontend_has_no_torch_loaded(server, client, model_name):
    """The live `ember serve` front end (engine loaded, a request served) never loaded torch,
    while its engine process did."""
    client.completions.create(model=model_name, prompt="Hi", max_tokens=2)
    frontend = server.process.pid
    assert not _maps_torch(frontend)
    assert any(_maps_torch(pid) for pid in _children(frontend))  # the check does see torch
