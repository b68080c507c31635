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
    """The sharding of ``leaf`` (in its type, when traced) when its mesh has an explicit axis, else ``None``.

    Example:
        >>> import jax.numpy as jnp
        >>> explicit_sharding(jnp.ones(2)) is None   # one device, no explicit axis
        True
    """
    if isinstance(leaf, jax.core.Tracer):
        sharding = getattr(jax.typeof(leaf), "sharding", None)
    else:  # a concrete array's own sharding: no aval built for every leaf of every eager update
        sharding = getattr(leaf, "sharding", None)
    axis_types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    if not any(t == AxisType.Explicit for t in axis_types):
        return None
    return sharding


def _like(new: Any, sharding: Any) -> Any:
    if sharding is None or explicit_sharding(new) == sharding:
        return new
    return jax.sharding.reshard(new, sharding)


def resharded_like(x: Any, target: Any) -> Any:
    """``x`` resharded to ``target``'s sharding where ``target`` is on an explicit mesh, else ``x``.

    Explicit axes refuse a ``jnp.where`` over values of two shardings (a param
    and its ZeRO-split master): one of them is brought to the other's first.

    Example:
        >>> import jax.numpy as jnp
        >>> resharded_like(jnp.ones(2), jnp.zeros(2))
        Array([1., 1.], dtype=float32)
    """
    return _like(x, explicit_sharding(target))


def like_inputs(new: Any, old: Any) -> Any:
    """``new`` with each leaf resharded to the explicit sharding of the leaf of ``old`` it replaces.

    ``new`` and ``old`` have the same structure (``{name: param}``, or a
    ``LookaheadParams`` of them); leaves off an explicit mesh are returned as
    they are, and ``new`` itself when no leaf of ``old`` is on one.

    Example:
        >>> import jax.numpy as jnp
        >>> like_inputs({"w": jnp.zeros(2)}, {"w": jnp.ones(2)})
        {'w': Array([0., 0.], dtype=float32)}
    """
    if old is None:
        return new
    targets = [explicit_sharding(leaf) for leaf in jax.tree.leaves(old)]
    if not any(target is not None for target in targets):
        return new
    leaves, treedef = jax.tree.flatten(new)
    return jax.tree.unflatten(
        treedef, [_like(leaf, target) for leaf, target in zip(leaves, targets, strict=True)]
    )
