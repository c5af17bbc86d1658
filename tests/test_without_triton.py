"""The CPU path runs without Triton (the default install has none), and asking for the GPU path
without it is one clear error that says what to install.

Each case runs in a fresh interpreter whose `sitecustomize` blocks `import triton` (a None in
`sys.modules`), as on a machine where it was never installed; the engine process a server
spawns runs the same `sitecustomize`, so it is blocked there too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BLOCK_TRITON = 'import sys\nsys.modules["triton"] = None\n'


@pytest.fixture(scope="module")
def no_triton_env(tmp_path_factory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("no_triton")
    (site / "sitecustomize.py").write_text(BLOCK_TRITON)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_python(code: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_triton_is_really_blocked(no_triton_env):
    result = run_python("import triton", no_triton_env)
    assert result.returncode != 0 and "import of triton halted" in result.stderr


def test_offline_generation_on_the_cpu_needs_no_triton(no_triton_env):
    result = run_python(
        """
        import sys
        from ember import LLM, SamplingParams

        out = LLM(device="cpu", max_model_len=256).generate(
            ["The capital of France is"], SamplingParams(max_tokens=8, temperature=0)
        )
        print(repr(out[0].outputs[0].text))
        loaded = [m for m, v in sys.modules.items() if m.split(".")[0] == "triton" and v]
        assert not loaded, loaded
        """,
        no_triton_env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() not in ("", "''")


def test_asking_for_the_triton_path_names_the_package_to_install(no_triton_env):
    result = run_python(
        """
        from ember import LLM
        from ember.dependencies import MissingDependencyError

        try:
            LLM(device="cpu", backend="triton", max_model_len=256)
        except MissingDependencyError as exc:
            print("refused:", exc)
        """,
        no_triton_env,
    )
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout and "pip install 'ember[gpu]'" in result.stdout


def test_serve_on_cuda_without_triton_fails_in_one_line(no_triton_env, tmp_path):
    """`ember serve --device cuda` refuses before it starts an engine: exit 1, the install hint
    in the log, and no traceback."""
    result = subprocess.run(
        [sys.executable, "-m", "ember.cli", "serve", "--device", "cuda", "--port", "0"],
        env=no_triton_env,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 1, log
    assert "pip install 'ember[gpu]'" in log
    assert "Traceback" not in log


def test_an_engine_process_without_triton_reports_one_line(no_triton_env):
    """Where only the engine process finds out (``--device auto`` on a GPU machine), it reports
    the same line to the front end and logs no traceback."""
    result = run_python(
        """
        import asyncio

        from ember.config import EngineConfig
        from ember.server.engine_client import EngineClient

        async def main():
            config = EngineConfig(model=None, device="cpu", backend="triton", served_model_name="m")
            client = EngineClient([config])
            await client.start()
            loaded = await client.wait_loaded()
            print("loaded" if loaded else f"failed: {client.failure}")
            await client.stop()

        asyncio.run(main())
        """,
        no_triton_env,
    )
    assert result.returncode == 0, result.stderr
    assert "failed: the GPU path needs Triton" in result.stdout, result.stdout + result.stderr
    assert "pip install 'ember[gpu]'" in result.stdout
    assert "Traceback" not in result.stderr, result.stderr
