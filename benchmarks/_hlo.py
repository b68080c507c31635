"""What a compiled program does across devices, read from its optimized HLO: collectives, their bytes, FLOPs.

:func:`read` takes a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``)
and returns a :class:`Program`: each collective (all-gather, all-to-all,
all-reduce, reduce-scatter, collective-permute, synchronous or started
asynchronously) with the bytes of its result on one device and whether it
sits inside a loop body (a ``while``'s body, or a computation that body
calls), and XLA's count of the program's floating-point operations on one
device.

Example:
    >>> import jax, jax.numpy as jnp
    >>> program = read(jax.jit(lambda x: x @ x).lower(jnp.ones((4, 4))).compile())
    >>> program.collectives, program.flops > 0
    ([], True)
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

KINDS = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute")
_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s(" + "|".join(KINDS) + r")(-start)?\(")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(
    r"(?:body|condition|to_apply|calls|branch_computations|true_computation|false_computation)=\{?%?([\w.\-, %]+)\}?"
)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a program: its kind, the bytes of its result on one device, and where it runs."""

    kind: str
    bytes: int
    computation: str
    in_loop: bool


@dataclasses.dataclass(frozen=True)
class Program:
    """The collectives and FLOPs of one compiled program, per device."""

    collectives: list[Collective]
    flops: float

    def bytes(self) -> int:
        """The bytes all the collectives bring to one device."""
        return sum(c.bytes for c in self.collectives)

    def count(self, kind: str | None = None) -> int:
        """How many collectives (of ``kind``) the program runs."""
        return sum(1 for c in self.collectives if kind is None or c.kind == kind)

    def in_loops(self) -> list[Collective]:
        """The collectives inside a loop body: run once an iteration."""
        return [c for c in self.collectives if c.in_loop]


def _shape_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        total += math.prod(int(d) for d in dims.split(",") if d) * _BYTES[dtype]
    return total


def read(compiled: Any) -> Program:
    """The :class:`Program` of a compiled JAX function."""
    text = compiled.as_text()
    calls: dict[str, set[str]] = {}
    bodies: set[str] = set()
    found: list[tuple[str, str, int]] = []
    current = ""
    for line in text.splitlines():
        header = _HEADER.match(line) if line and not line.startswith(" ") else None
        if header:
            current = header.group(1)
            calls.setdefault(current, set())
            continue
        for group in _CALLS.findall(line):
            names = {name.strip().lstrip("%") for name in group.split(",") if name.strip()}
            calls.setdefault(current, set()).update(names)
        body = re.search(r"\bbody=%?([\w.\-]+)", line)
        if body and " while(" in line:
            bodies.add(body.group(1))
        op = _OP.match(line)
        if op:
            found.append((op.group(2), current, _shape_bytes(op.group(1))))
    in_loop = set()
    pending = list(bodies)
    while pending:
        name = pending.pop()
        if name in in_loop:
            continue
        in_loop.add(name)
        pending.extend(calls.get(name, ()))
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    flops = float((analysis or {}).get("flops", 0.0))
    return Program([Collective(kind, size, where, where in in_loop) for kind, where, size in found], flops)
