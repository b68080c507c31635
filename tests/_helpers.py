"""Helpers shared by the test modules: trees compared leaf by leaf, device meshes, the repository, pages' code."""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, PartitionSpec

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


_AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def device_mesh(
    shape: Sequence[int],
    names: Sequence[str],
    axis_types: str | AxisType = "auto",
    *,
    devices: Sequence[Any] | None = None,
) -> Mesh:
    """A mesh of the first ``prod(shape)`` of ``devices`` (``jax.devices()`` by default), in their order.

    ``axis_types`` gives every axis the same type: ``"auto"`` (what ``Mesh(devices, names)``
    gives), ``"explicit"``, a ``jax.sharding.AxisType``, or ``"default"``: whatever
    ``jax.make_mesh`` gives when told none, as a new user writes it (explicit in current JAX,
    auto in older releases). On CPU ``jax.make_mesh`` keeps the devices' order too, so every
    kind lays the devices out alike.

    The tests run on 8 virtual CPU devices (``tests/conftest.py`` sets ``XLA_FLAGS``); too few
    devices fail the test, naming the flag. A Python child a test starts needs that flag in
    its environment and ``tests/`` on its ``PYTHONPATH`` to import this module.

    Example:
        >>> mesh = device_mesh((4, 2), ("data", "model"), "explicit")
        >>> dict(mesh.shape), [d.id for d in mesh.devices.flat]
        ({'data': 4, 'model': 2}, [0, 1, 2, 3, 4, 5, 6, 7])
        >>> mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
        True
        >>> device_mesh((2,), ("x",)).axis_types == (AxisType.Auto,)
        True
    """
    devices = list(jax.devices() if devices is None else devices)
    size = math.prod(shape)
    if len(devices) < size:
        pytest.fail(
            f"a {tuple(shape)} mesh needs {size} devices, there are {len(devices)}: "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8"
        )
    devices = devices[:size]
    if axis_types == "default":
        return jax.make_mesh(tuple(shape), tuple(names), devices=devices)
    if isinstance(axis_types, str):
        if axis_types not in _AXIS_TYPES:
            raise ValueError(f"axis_types={axis_types!r}: 'auto', 'explicit', 'default' or an AxisType")
        axis_types = _AXIS_TYPES[axis_types]
    return Mesh(np.array(devices).reshape(tuple(shape)), tuple(names), axis_types=(axis_types,) * len(names))


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
