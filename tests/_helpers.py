"""Helpers shared by the test modules: trees compared leaf by leaf, the repository, code blocks of pages."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

ROOT = Path(__file__).resolve().parents[1]
"""The repository's root."""


def assert_trees_equal(actual: Any, expected: Any) -> None:
    """Same structure and the same values, bit for bit."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def assert_trees_close(actual: Any, expected: Any, *, same_dtypes: bool = False, **tol: float) -> None:
    """Same structure and values within ``tol`` (``rtol=``, ``atol=`` of ``np.testing.assert_allclose``).

    With ``same_dtypes``, every leaf also has the dtype and shape of the expected one.
    Floating leaves are compared in float64, which holds every narrower float
    exactly (NumPy 1.x's ``allclose`` cannot promote bfloat16).
    """
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        if same_dtypes:
            assert (a.dtype, a.shape) == (e.dtype, e.shape)
        np.testing.assert_allclose(_comparable(a), _comparable(e), **tol)


def _comparable(x: Any) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(np.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x


FENCE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>```+)(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$",
    re.M | re.S,
)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number, code)`` of every fenced block whose language is exactly ``python``."""
    blocks = []
    for match in FENCE.finditer(text):
        info = match["info"].strip().split()
        if info and info[0] in ("python", "{.python"):
            line = text.count("\n", 0, match.start("body")) + 1
            blocks.append((line, textwrap.dedent(match["body"])))
    return blocks


def is_spec(x: Any) -> bool:
    """A leaf of a spec tree: a ``PartitionSpec`` or ``None`` (replicated)."""
    return x is None or isinstance(x, PartitionSpec)


def x64() -> Any:
    """A context with 64-bit types enabled: ``jax.enable_x64`` where JAX has it (the lower bound's is experimental)."""
    enable = getattr(jax, "enable_x64", None)
    if enable is None:
        from jax.experimental import enable_x64 as enable
    return enable(True)
