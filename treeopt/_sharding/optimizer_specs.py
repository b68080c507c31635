"""The partition specs of an optimizer's state: derived from the params' specs, with ZeRO-1 when asked.

:func:`optimizer_state_specs` is what ``Optimizer.partition_specs`` returns
for the state: :mod:`treeopt._sharding.specs` derives each leaf's spec from its
parameter's, and with ``shard_state_over`` :mod:`treeopt._sharding.zero` adds the
data-parallel axes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from treeopt._sharding.ownership import OwnedLeaf, OwnedRules, whole_leaves
from treeopt._sharding.specs import check_axes, flat_param_specs, state_leaf_specs
from treeopt._sharding.zero import zero_plan
from treeopt._tree.children import OPT_STATE
from treeopt._tree.layout import ParamLayout


def state_specs(
    parts: Mapping[str, Any],
    layout: ParamLayout,
    param_specs: Mapping[str, PartitionSpec],
    *,
    shard_state_over: str | Sequence[str] | None = None,
    mesh: Any = None,
    whole: Sequence[OwnedLeaf] = (),
    unsplit: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """``{part: tree shaped like it with a PartitionSpec at every leaf}`` for the parts of a state.

    ``parts`` are the trees of a state whose leaves may belong to parameters,
    by name: the optax state over the flat ``{name: param}`` dict, the master
    copies, the rounding state (``{"opt_state": ..., "master": ...}``), concrete or abstract
    (``jax.eval_shape``); ``param_specs`` is ``{name: spec}`` for every
    trainable param. With ``shard_state_over`` (mesh axis names, and the
    ``mesh`` whose sizes they have) the param-owned leaves are also split over
    those axes (ZeRO-1, see :func:`treeopt._sharding.zero.zero_plan`); ``whole``
    are the params whose update reads matrices whole (their layers split first);
    ``unsplit``, the parts ZeRO-1 never splits (their children say so).
    """
    if shard_state_over is None:
        sizes = {name: int(size) for name, size in dict(mesh.shape).items()} if mesh is not None else None
        out = {}
        for part, tree in parts.items():
            treedef, leaves = state_leaf_specs(tree, layout, param_specs, sizes)
            out[part] = jax.tree_util.tree_unflatten(treedef, [leaf.spec for leaf in leaves])
        return out
    treedefs, plan = zero_plan(parts, layout, param_specs, shard_state_over, mesh, whole, unsplit)
    specs = iter(leaf.zero_spec for leaf in plan.leaves)
    return {
        part: treedef.unflatten([next(specs) for _ in range(treedef.num_leaves)])
        for part, treedef in treedefs.items()
    }


def optimizer_state_specs(
    parts: Mapping[str, Any],
    layout: ParamLayout,
    param_specs: Any,
    *,
    shard_state_over: str | Sequence[str] | None = None,
    mesh: Any = None,
    tx: Any = None,
    owned: OwnedRules | None = None,
    unsplit: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """The specs of a state's parts from a params-shaped tree of specs, checked; what ``partition_specs`` uses.

    ``parts`` are the trees of the state by name (see :func:`state_specs`);
    ``param_specs`` is any params-shaped tree (or the flat dict) of
    ``PartitionSpec``/``None``, checked by :func:`flat_param_specs`; with a
    ``mesh`` each spec's axes are also checked against it (the error names the
    parameter). ``parts`` and ``shard_state_over``: see :func:`state_specs`;
    ``tx`` and ``owned``, the optimizer's, find the params whose update reads
    matrices whole (:func:`whole_leaves_of`); ``unsplit``: see :func:`state_specs`.
    """
    flat = checked_param_specs(param_specs, layout, mesh)
    whole = whole_leaves_of(tx, parts.get(OPT_STATE.view), layout, mesh, owned) if shard_state_over else []
    return state_specs(
        parts, layout, flat, shard_state_over=shard_state_over, mesh=mesh, whole=whole, unsplit=unsplit
    )


def whole_leaves_of(
    tx: Any, opt_state: Any, layout: ParamLayout, mesh: Any, owned: OwnedRules | None
) -> list[OwnedLeaf]:
    """The params whose update under ``tx`` reads matrices whole, with their owners among ``mesh``'s devices.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, optax
        >>> from jax.sharding import Mesh
        >>> from treeopt._tree.layout import ParamLayout
        >>> params = {"w": jnp.ones((8, 4)), "b": jnp.ones(4)}
        >>> tx = optax.contrib.muon(1e-2)
        >>> mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
        >>> [leaf.param for leaf in whole_leaves_of(tx, tx.init(params), ParamLayout.of(params), mesh, None)]
        ['w']
    """
    if tx is None or mesh is None or opt_state is None:
        return []
    avals = {
        name: jax.ShapeDtypeStruct(tuple(shape), dtype)
        for name, (shape, dtype) in zip(layout.names, layout.avals, strict=True)
    }
    return whole_leaves(tx, opt_state, avals, int(math.prod(dict(mesh.shape).values())), owned)


def checked_param_specs(param_specs: Any, layout: ParamLayout, mesh: Any) -> dict[str, PartitionSpec]:
    """``{name: spec}`` from a params-shaped tree of specs; with a ``mesh``, each spec's axes checked
    against it (the error names the parameter)."""
    flat = flat_param_specs(param_specs, layout)
    if mesh is not None:
        for name, spec in flat.items():
            check_axes(spec, mesh, f"PartitionSpec of parameter '{name}'")
    return flat
