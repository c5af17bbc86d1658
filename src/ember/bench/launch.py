"""Start an `ember serve` process for a benchmark, wait until it is healthy, and stop it after.

The server runs in its own process session so that everything it spawns (the engine process)
can be cleaned up with it, and its output goes to a log file whose tail explains a failed start.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

LOG_TAIL_LINES = 40
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


class ServerStartError(RuntimeError):
    """The launched server exited or never became healthy."""


def ember_serve_program() -> tuple[str, ...]:
    """`ember serve` run by this interpreter, so the server uses the same environment."""
    return (sys.executable, "-m", "ember.cli", "serve")


@dataclass(frozen=True)
class LaunchSpec:
    """How to start the server: model (None: the server's default), extra flags, and an
    optional CPU list for `taskset -c` (e.g. "0" or "0-3,8")."""

    model: str | None = None
    server_args: tuple[str, ...] = ()
    cpus: str | None = None
    startup_timeout_s: float = 600.0
    log_path: str | None = None
    program: tuple[str, ...] = field(default_factory=ember_serve_program)
    health_poll_s: float = 0.25  # how often /health is asked while the server starts


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(spec: LaunchSpec, port: int) -> list[str]:
    """The argv that starts `ember serve` on `port`, under taskset when CPUs are given."""
    command = list(spec.program)
    if spec.model:
        command.append(spec.model)
    # Listen on loopback only: the benchmark client is local. Later --host in server_args wins.
    command += ["--host", "127.0.0.1", "--port", str(port), *spec.server_args]
    if spec.cpus:
        command = ["taskset", "-c", spec.cpus, *command]
    return command


class LaunchedServer:
    """A running `ember serve` for the length of a `with` block.

    `base_url`, `pid` and `command` are set once the block is entered; `pid` is the server's
    own process (taskset replaces itself with it), the root of the tree the costs sample.
    `started_at`, `first_answer_at` (the first /health answer, 503 while loading) and
    `healthy_at` are the start's moments (time.time()).
    """

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = server_command(spec, self.port)
        self._process: subprocess.Popen | None = None
        self._log_is_temporary = spec.log_path is None
        self._log_path = Path(spec.log_path or _temporary_log_path())
        self.started_at = self.first_answer_at = self.healthy_at = 0.0

    @property
    def pid(self) -> int:
        """The server process id."""
        return self._process.pid

    def __enter__(self) -> Self:
        with open(self._log_path, "wb") as log:
            self.started_at = time.time()
            self._process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # Safe here despite threads: prctl is resolved beforehand, the child only calls it.
                preexec_fn=_terminate_with_parent_hook(),  # noqa: PLW1509
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.stop()
        if exc_type is None and self._log_is_temporary:
            self._log_path.unlink(missing_ok=True)  # kept only when something went wrong

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise ServerStartError(
                    f"server exited with code {self._process.returncode}\n{self.log_tail()}"
                )
            status = _health_status(self.base_url)
            if status is not None and not self.first_answer_at:
                self.first_answer_at = time.time()
            if status == 200:
                self.healthy_at = time.time()
                return
            time.sleep(self.spec.health_poll_s)
        raise ServerStartError(
            f"server not healthy after {self.spec.startup_timeout_s:.0f}s\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the server and wait; then SIGKILL whatever is left of its process group."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self._process.pid, signal.SIGKILL)  # stragglers such as an engine process
        except (ProcessLookupError, PermissionError):
            pass
        self._process.wait()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines of the server's output, with the command that produced it."""
        text = self._log_path.read_text(errors="replace") if self._log_path.exists() else ""
        tail = "\n".join(text.splitlines()[-lines:])
        return f"$ {shlex.join(self.command)}\n--- server log ({self._log_path}) ---\n{tail}"


def _terminate_with_parent_hook() -> Callable[[], object] | None:
    """A function for the server's process to run before exec, asking the kernel to SIGTERM it
    if the benchmark process dies first (killed by a timeout, say), so that no server is left
    behind. Linux only; None elsewhere."""
    if sys.platform != "linux":
        return None
    return functools.partial(ctypes.CDLL(None).prctl, PR_SET_PDEATHSIG, int(signal.SIGTERM))


def _temporary_log_path() -> str:
    fd, path = tempfile.mkstemp(prefix="ember-serve-", suffix=".log")
    os.close(fd)
    return path


def _health_status(base_url: str) -> int | None:
    """The HTTP status /health answers with; None if nothing answers."""
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None
