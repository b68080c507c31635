"""Typed PRNG keys as state-dict leaves: their ``uint32`` key data, and back.

State dicts, checkpoints and checksums hold plain arrays, so a typed key
(``jax.random.key``, as ``optax.noisy_sgd`` keeps in its state) is written as
its key data and wrapped back with the template leaf's key implementation on
load. Abstract keys (``ShapeDtypeStruct``) map to abstract key data.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from treeopt._compat.jax_private import abstract_key_impl

__all__ = ["is_key", "key_data", "wrap_key_like"]


def is_key(x: Any) -> bool:
    """True for typed PRNG key arrays and their abstract ``ShapeDtypeStruct``.

    Example:
        >>> import jax
        >>> is_key(jax.random.key(0)), is_key(jax.random.PRNGKey(0))
        (True, False)
    """
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def key_data(x: Any) -> Any:
    """``x``'s ``uint32`` key data if it is a typed key (abstract for an abstract key), else ``x``.

    Example:
        >>> import jax
        >>> key_data(jax.random.key(0)).dtype, key_data(1.5)
        (dtype('uint32'), 1.5)
    """
    if not is_key(x):
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.eval_shape(jax.random.key_data, x)
    return jax.random.key_data(x)


def key_impl(leaf: Any) -> Any:
    """The key implementation of a typed key, concrete or abstract.

    Example:
        >>> import jax
        >>> str(key_impl(jax.random.key(0)))
        'threefry2x32'
    """
    if isinstance(leaf, jax.Array):
        return jax.random.key_impl(leaf)
    return abstract_key_impl(leaf.dtype)


def wrap_key_like(template: Any, value: Any) -> Any:
    """``value`` (key data) wrapped as a typed key like ``template``; other values as they are.

    Example:
        >>> import jax
        >>> key = jax.random.key(3)
        >>> restored = wrap_key_like(key, key_data(key))
        >>> bool((jax.random.key_data(restored) == jax.random.key_data(key)).all()), is_key(restored)
        (True, True)
    """
    if not is_key(template) or is_key(value):
        return value
    return jax.random.wrap_key_data(jnp.asarray(value, jnp.uint32), impl=key_impl(template))
