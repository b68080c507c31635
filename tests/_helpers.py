"""Assertions shared by the test modules: trees compared leaf by leaf."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


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
