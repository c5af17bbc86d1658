"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` function is defined, i.e. before
``ember.kernels`` is imported; ``setdefault`` lets a GPU run pass ``TRITON_INTERPRET=0`` to
test the compiled kernels on the device instead.
"""

import os
import random

import pytest
import torch


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where kernel inputs live: the CPU under the interpreter, else the GPU."""
    if not _interpreting() and torch.cuda.is_available():
        return torch.device("cuda")
    if not _interpreting():
        pytest.skip("compiled Triton kernels need a CUDA GPU")
    return torch.device("cpu")


# Fresh inputs every run; rerun with EMBER_KERNEL_SEED=<printed seed> to reproduce a failure.
_SESSION_SEED = int(os.environ.get("EMBER_KERNEL_SEED", random.randrange(2**31)))


def pytest_report_header(config):
    return f"kernel tests: EMBER_KERNEL_SEED={_SESSION_SEED}"


@pytest.fixture
def gen(request) -> torch.Generator:
    """CPU generator seeded from the session seed and the test id."""
    test_hash = sum(ord(c) * 31**i for i, c in enumerate(request.node.nodeid)) % 2**31
    print(f"EMBER_KERNEL_SEED={_SESSION_SEED}")  # shown with a failure's captured output
    return torch.Generator().manual_seed(_SESSION_SEED ^ test_hash)
