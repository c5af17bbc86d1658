"""Start and stop a real `ember serve` as a subprocess, and read its /metrics."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

API_KEY = "test-key"
STARTUP_TIMEOUT_S = 240.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`python -m ember.cli serve` in its own process group, logging to a file."""

    def __init__(self, *flags: str, api_key: str | None = API_KEY) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.command = [
            sys.executable,
            "-m",
            "ember.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--disable-progress-bar",
            "--disable-uvicorn-access-log",
            *flags,
        ]
        fd, log_path = tempfile.mkstemp(prefix="ember-test-server-", suffix=".log")
        os.close(fd)
        self.log_path = Path(log_path)
        self.process: subprocess.Popen | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self) -> ServerProcess:
        """Launch and wait until /health says 200."""
        self.launch()
        self.wait_for(lambda status: status == 200, "healthy")
        return self

    def launch(self) -> ServerProcess:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def wait_for(self, ready, what: str) -> int:
        """Poll /health until `ready(status_code)`; the last status code."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited ({self.process.returncode}):\n{self.log()}")
            try:
                status = httpx.get(self.base_url + "/health", timeout=2).status_code
                if ready(status):
                    return status
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        log = self.log()
        self.kill()
        raise RuntimeError(f"server not {what} after {STARTUP_TIMEOUT_S} s:\n{log}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait; the exit code."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        """Whatever is left of the process group goes (the engine too); the log goes too,
        unless it holds a traceback worth reading."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        if "Traceback" in self.log_path.read_text(errors="replace"):
            print(f"server log kept: {self.log_path}")
        else:
            self.log_path.unlink(missing_ok=True)

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.base_url + "/v1",
            api_key=self.api_key or "none",
            max_retries=0,
            **kwargs,
        )

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.base_url + "/v1",
            api_key=self.api_key or "none",
            max_retries=0,
            **kwargs,
        )

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as {"name{labels}": value}."""
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def metric(self, name: str) -> float:
        """The sum of a metric's samples over all label sets."""
        return sum(v for k, v in self.metrics().items() if k.split("{")[0] == name)

    def wait_for_metric(self, name: str, value: float, timeout: float = 20.0) -> float:
        """The metric once it equals `value`, or its last value after `timeout` seconds (the
        engine's stats come every ~0.5 s)."""
        deadline = time.monotonic() + timeout
        while True:
            current = self.metric(name)
            if current == value or time.monotonic() > deadline:
                return current
            time.sleep(0.1)
