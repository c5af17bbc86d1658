"""Shared pytest setup: make `tests/helpers` importable as `helpers`."""

import sys
from pathlib import Path

_TESTS_DIR = str(Path(__file__).parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

# Before anything imports ember.kernels: interpret Triton on a CPU (see the helper).
from helpers import triton_interpreter

triton_interpreter.configure()
