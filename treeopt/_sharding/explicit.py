"""JAX's explicit sharding mode: a step computes in the state's layout and returns values in the inputs'.

Under explicit mesh axes a value's sharding is part of its type, and the
arithmetic of a step propagates the state's shardings into the new params
(ZeRO-1's data axis in particular). A model that was written for its params'
own shardings then fails at the next step with ``ShardingTypeError``, so
:func:`like_inputs` reshards each new value to the type of the value it
replaces. Inside the step, :func:`in_state_layout` first brings each grad and
param to the layout of its state (a ZeRO shard within a model shard,
``P(("model", "data"))``, meets a grad of ``P("model")`` there: the slice is
local). Under auto axes a traced value's sharding is not known: there the
shardings ``jax.jit`` is given decide; a concrete value (an update run
eagerly) is placed back on its input's sharding whatever the axis types.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AxisType

from treeopt._sharding.specs import is_self_specified


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
    return sharding if is_explicit(getattr(sharding, "mesh", None)) else None


def is_explicit(mesh: Any) -> bool:
    """Whether ``mesh`` has an explicit axis (``None``, or no mesh: ``False``).

    Example:
        >>> import jax
        >>> is_explicit(jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,)))
        True
    """
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _placement(leaf: Any) -> Any:
    """The ``NamedSharding`` of a concrete ``leaf`` on a mesh of several devices, else ``None``."""
    if isinstance(leaf, jax.core.Tracer):
        return None
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    return sharding if sharding.mesh.size > 1 else None


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


def _placed_like(new: Any, old: Any) -> Any:
    """A concrete ``new`` on the sharding of a concrete ``old`` (on a mesh of several devices), else ``None``."""
    sharding = _placement(old)
    if (
        sharding is None
        or isinstance(new, jax.core.Tracer)
        or not isinstance(new, jax.Array)
        or new.sharding.is_equivalent_to(sharding, new.ndim)
    ):
        return None
    return jax.device_put(new, sharding)


def like_inputs(new: Any, old: Any) -> Any:
    """``new`` with each leaf resharded to the sharding of the leaf of ``old`` it replaces.

    ``new`` and ``old`` have the same structure (``{name: param}``, or a
    ``LookaheadParams`` of them). Under explicit axes each leaf takes its
    input's type; a concrete leaf (an eager update) is placed on its input's
    sharding on any mesh; other leaves are returned as they are, and ``new``
    itself when no leaf of ``old`` is on a mesh.

    Example:
        >>> import jax.numpy as jnp
        >>> like_inputs({"w": jnp.zeros(2)}, {"w": jnp.ones(2)})
        {'w': Array([0., 0.], dtype=float32)}
    """
    if old is None:
        return new
    old_leaves = jax.tree.leaves(old)
    targets = [explicit_sharding(leaf) for leaf in old_leaves]
    placed = any(_placement(leaf) is not None for leaf in old_leaves)
    if not placed and not any(target is not None for target in targets):
        return new
    leaves, treedef = jax.tree.flatten(new)
    out = []
    for leaf, before, target in zip(leaves, old_leaves, targets, strict=True):
        placed = _placed_like(leaf, before)
        out.append(placed if placed is not None else _like(leaf, target))
    return jax.tree.unflatten(treedef, out)


def placements(tree: Any) -> tuple[Any, ...]:
    """The ``NamedSharding`` of each concrete leaf of ``tree`` on a mesh of several devices, else ``None``.

    What a layer that holds its params across traced steps (the nnx drop-in)
    keeps, to place the new values under auto axes, where a traced value's
    sharding is not known.

    Example:
        >>> import jax.numpy as jnp
        >>> placements({"w": jnp.ones(2)})   # one device: nothing to keep
        (None,)
    """
    return tuple(_placement(leaf) for leaf in jax.tree.leaves(tree))


def placed_like(new: Any, old: Any, kept: tuple[Any, ...] | None = None) -> Any:
    """``new`` with each leaf on the sharding of the leaf of ``old`` it replaces, also under auto axes.

    As :func:`like_inputs`, and a traced leaf off an explicit mesh is
    constrained to its entry of ``kept`` (from :func:`placements` of the
    values ``old`` stands for, taken while they were concrete).

    Example:
        >>> import jax.numpy as jnp
        >>> placed_like({"w": jnp.zeros(2)}, {"w": jnp.ones(2)}, (None,))
        {'w': Array([0., 0.], dtype=float32)}
    """
    new = like_inputs(new, old)
    leaves, treedef = jax.tree.flatten(new)
    if kept is None or len(kept) != len(leaves):
        return new
    out = [
        jax.lax.with_sharding_constraint(leaf, sharding)
        if sharding is not None and isinstance(leaf, jax.core.Tracer) and explicit_sharding(leaf) is None
        else leaf
        for leaf, sharding in zip(leaves, kept, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)


def in_state_layout(grads: Any, params: Any, *states: Any) -> tuple[Any, Any]:
    """``(grads, params)`` with each leaf resharded, under explicit axes, to the layout of its state.

    A leaf's state is the first leaf of ``states`` (the optax state, the
    precision's) whose key path holds the leaf's key path (as the optax state
    of ``{name: param}`` holds ``DictKey(name)``), with the leaf's shape and
    an explicit sharding; a low-bit leaf is asked which of its arrays is laid
    out as its param (8-bit codes are). ZeRO-1 gives every state leaf shaped like a
    param one layout, so the step's arithmetic then never meets two layouts
    on one dimension. Leaves with no such state, and everything off an
    explicit mesh, are returned as they are.

    Example:
        >>> import jax.numpy as jnp
        >>> grads, params = in_state_layout({"w": jnp.ones(2)}, None, {"mu": {"w": jnp.zeros(2)}})
        >>> grads["w"].tolist(), params
        ([1.0, 1.0], None)
    """
    flat, treedef_ = jax.tree_util.tree_flatten_with_path(grads)
    treedef: Any = treedef_
    if not flat or not any(explicit_sharding(leaf) is not None for _, leaf in flat):
        return grads, params
    wanted = {tuple(path): i for i, (path, _) in enumerate(flat)}
    lengths = sorted({len(path) for path in wanted})
    layouts: dict[int, Any] = {}
    for state in states:
        for path, leaf in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_self_specified)[0]:
            path = tuple(path)
            if is_self_specified(leaf):
                leaf = leaf.laid_out_as_param()
                if leaf is None:
                    continue
            for n in lengths:
                i = wanted.get(path[len(path) - n :]) if len(path) >= n else None
                if (
                    i is not None
                    and i not in layouts
                    and tuple(getattr(leaf, "shape", ())) == flat[i][1].shape
                ):
                    sharding = explicit_sharding(leaf)
                    if sharding is not None:
                        layouts[i] = sharding
    if not layouts:
        return grads, params
    new_grads = [_like(leaf, layouts.get(i)) for i, (_, leaf) in enumerate(flat)]
    if params is not None and jax.tree.structure(params) == treedef:
        params = treedef.unflatten(
            [_like(leaf, layouts.get(i)) for i, leaf in enumerate(jax.tree.leaves(params))]
        )
    return treedef.unflatten(new_grads), params
