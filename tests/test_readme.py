"""What README.md tells a user to copy runs against the code as it is: the offline API example,
the one-liner, the curl examples and the openai client examples (served as the README's own
`ember serve` line serves them: `--served-model-name llama --api-key secret`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from server.server_process import ServerProcess

pytestmark = pytest.mark.slow

README = (Path(__file__).parents[1] / "README.md").read_text()
README_URL = "http://localhost:8000"


def fenced_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.MULTILINE | re.DOTALL)


def blocks_with(language: str, needle: str) -> list[str]:
    found = [block for block in fenced_blocks(language) if needle in block]
    assert found, f"README.md has no {language} block with {needle!r}"
    return found


def run_python(code: str, timeout: float = 600) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{code}\n---\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def readme_server():
    """The README's server for its client examples, sized for a 2-core CPU."""
    flags = (
        "--served-model-name",
        "llama",
        "--max-model-len",
        "1024",
        "--num-gpu-blocks-override",
        "200",
    )
    process = ServerProcess(*flags, api_key="secret").start()
    yield process
    process.kill()


def as_served_by(block: str, server: ServerProcess) -> str:
    assert README_URL in block, f"the README's examples talk to {README_URL}"
    return block.replace(README_URL, server.base_url)


def test_offline_api_example_runs():
    (example,) = blocks_with("python", "from ember import LLM")
    lines = run_python(example).splitlines()
    assert any(line.strip() for line in lines)
    # Three prompts, each printed with its finish reason, then the chat answer.
    assert sum(line.rstrip().endswith(("stop", "length")) for line in lines) >= 3


def test_engine_example_runs():
    """The several-models example: both models answer, and the one put to sleep says so."""
    (example,) = blocks_with("python", "from ember import Engine")
    out = run_python(example)
    assert out.rstrip().endswith("sleeping loaded")
    assert len(out.strip().splitlines()) >= 3  # two completions (each may span lines), states


def test_offline_one_liner_prints_text():
    (block,) = blocks_with("bash", '.venv/bin/python -c "from ember import LLM')
    command = block.strip()
    code = re.fullmatch(r'\.venv/bin/python -c "(.*)"', command).group(1)
    assert run_python(code).strip()


def test_curl_examples_answer(readme_server):
    (block,) = blocks_with("bash", "curl ")
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", as_served_by(block, readme_server)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # The chat completion comes back as one JSON object, the streamed completion as events.
    reply, end = json.JSONDecoder().raw_decode(out)
    assert reply["choices"][0]["message"]["content"]
    events = [line[len("data: ") :] for line in out[end:].splitlines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] > 0  # stream_options.include_usage


def test_openai_client_examples_run(readme_server):
    for block in blocks_with("python", "from openai import OpenAI"):
        assert run_python(as_served_by(block, readme_server)).strip()
