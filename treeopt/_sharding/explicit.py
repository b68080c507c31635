"""JAX's explicit sharding mode: the new params take the sharding the given ones came in with.

Under explicit mesh axes a value's sharding is part of its type, and the
arithmetic of a step propagates the state's shardings into the new params
(ZeRO-1's data axis in particular). A model that was written for its params'
own shardings then fails at the next step with ``ShardingTypeError``, so
:func:`like_inputs` reshards each new value to the type of the value it
replaces. Under auto axes (or off a mesh) nothing is changed: there the
compiler already gathers the new values back to the params' shardings.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AxisType


def explicit_sharding(leaf: Any) -> Any:
    """The sharding in ``leaf``'s type when its mesh has an explicit axis, else ``None``.

    Example:
        >>> import jax.numpy as jnp
        >>> explicit_sharding(jnp.ones(2)) is None   # one device, no explicit axis
        True
    """
    try:
        aval = jax.typeof(leaf)
    except TypeError:
        return None
    sharding = getattr(aval, "sharding", None)
    axis_types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    if not any(t == AxisType.Explicit for t in axis_types):
        return None
    return sharding


def _like(new: Any, old: Any) -> Any:
    sharding = explicit_sharding(old)
    if sharding is None or explicit_sharding(new) == sharding:
        return new
    return jax.sharding.reshard(new, sharding)


def like_inputs(new: Any, old: Any) -> Any:
    """``new`` with each leaf resharded to the explicit sharding of the leaf of ``old`` it replaces.

    ``new`` and ``old`` have the same structure (``{name: param}``, or a
    ``LookaheadParams`` of them); leaves off an explicit mesh are returned as
    they are.

    Example:
        >>> import jax.numpy as jnp
        >>> like_inputs({"w": jnp.zeros(2)}, {"w": jnp.ones(2)})
        {'w': Array([0., 0.], dtype=float32)}
    """
    if old is None:
        return new
    return jax.tree.map(_like, new, old)
