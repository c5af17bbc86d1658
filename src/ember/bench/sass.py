"""A compiled kernel's machine code (SASS) read back: its loops, their instruction mix, and the
registers it takes, with the NVIDIA tools Triton ships (``nvdisasm``, ``cuobjdump``).

A loop is the code between a label and the branch that jumps back to it (what a ``for`` over K
compiles to). Its instruction count is what one thread issues per iteration, the figure a
decode-bound kernel's speed follows: on Hopper each SM sub-partition issues one warp instruction a
clock, so ``count / values a thread takes an iteration`` is the issue cost of one weight value.
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from dataclasses import dataclass
from functools import cache
from pathlib import Path

# "/*0940*/   @!P0 IMAD.SHL.U32 R31, R3, 0x8, RZ ;": address, optional predicate, opcode with its
# modifiers, operands.
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z0-9_.]+)\s*([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH_TARGET = re.compile(r"`?\((\.L_x_\d+)\)")
_RESOURCES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


@dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str  # with its modifiers: "IMAD.SHL.U32"
    operands: str

    @property
    def mnemonic(self) -> str:
        return self.opcode.split(".", 1)[0]


@dataclass(frozen=True)
class Loop:
    """The instructions from a loop's label to its backward branch, both included."""

    body: tuple[Instruction, ...]

    def mix(self, top: int = 12) -> list[tuple[str, int]]:
        """The most frequent opcodes (with modifiers) in the body, most first."""
        return Counter(i.opcode for i in self.body).most_common(top)


@dataclass(frozen=True)
class Resources:
    registers: int
    stack_bytes: int
    shared_bytes: int
    local_bytes: int  # spills


@cache
def _tool(name: str) -> Path:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{name} is not in this Triton's NVIDIA backend ({path})")
    return path


def disassemble(cubin: Path) -> str:
    return subprocess.run(
        [str(_tool("nvdisasm")), "-c", str(cubin)], capture_output=True, text=True, check=True
    ).stdout


def resources(cubin: Path) -> Resources:
    out = subprocess.run(
        [str(_tool("cuobjdump")), "-res-usage", str(cubin)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    match = _RESOURCES.search(out)
    if match is None:
        raise ValueError(f"no resource usage in cuobjdump's output for {cubin}")
    return Resources(*(int(group) for group in match.groups()))


def instructions(sass: str) -> tuple[list[Instruction], dict[str, int]]:
    """Every instruction in order, and each label's address."""
    found: list[Instruction] = []
    labels: dict[str, int] = {}
    pending: list[str] = []  # labels waiting for the instruction they name
    for line in sass.splitlines():
        if label := _LABEL.match(line.strip()):
            pending.append(label.group(1))
            continue
        if match := _INSTRUCTION.search(line):
            instruction = Instruction(int(match.group(1), 16), match.group(2), match.group(3))
            found.append(instruction)
            labels.update(dict.fromkeys(pending, instruction.address))
            pending.clear()
    return found, labels


def loops(sass: str) -> list[Loop]:
    """Each loop, in the order of its backward branch (an inner loop before the one that
    holds it)."""
    found, labels = instructions(sass)
    result = []
    for instruction in found:
        if instruction.mnemonic != "BRA":
            continue
        target = _BRANCH_TARGET.search(instruction.operands)
        start = labels.get(target.group(1)) if target else None
        if start is not None and start < instruction.address:
            body = tuple(i for i in found if start <= i.address <= instruction.address)
            result.append(Loop(body))
    return result
