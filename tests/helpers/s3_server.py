"""A real S3-compatible HTTP server for tests: `moto`'s server in a child process of its own.

A child process (not moto's in-thread server) so that a test can kill it mid-download the way a
store dies, and can start one that checks credentials (moto's switch for that is process-wide).
Objects are uploaded with `obstore`, the client ember uses; the bucket is created with a plain
HTTP PUT (moto creates buckets for anyone unless told to check credentials).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Self

ACCESS_KEY = "AKIAEMBERTEST0000000"
SECRET_KEY = "ember-test-secret-key"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class S3Server:
    """`moto` serving S3 on 127.0.0.1; `environ` is what a client needs to reach it."""

    def __init__(self, check_credentials: bool = False) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        if check_credentials:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"  # every request must be signed by a user
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the moto S3 server did not start") from None
                time.sleep(0.1)

    @property
    def environ(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
        }

    def create_bucket(self, bucket: str) -> None:
        request = urllib.request.Request(f"{self.endpoint}/{bucket}", method="PUT")
        with urllib.request.urlopen(request, timeout=30):
            pass

    def upload(self, bucket: str, prefix: str, directory: Path) -> list[str]:
        """Put every file under ``directory`` at ``prefix/<relative path>``; returns the keys."""
        import obstore
        from obstore.store import S3Store

        store = S3Store(
            bucket,
            endpoint=self.endpoint,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            region="us-east-1",
            client_options={"allow_http": True},
        )
        keys = []
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            key = f"{prefix}/{path.relative_to(directory).as_posix()}"
            obstore.put(store, key, path.read_bytes())
            keys.append(key)
        return keys

    def kill(self) -> None:
        """Die at once, as a store does when its machine goes away."""
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
