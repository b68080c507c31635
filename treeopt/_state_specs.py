"""The partition specs of an optimizer's state: derived from the params' specs, with ZeRO-1 when asked.

:func:`optimizer_state_specs` is what ``Optimizer.partition_specs`` returns
for the state: :mod:`treeopt._specs` derives each leaf's spec from its
parameter's, and with ``shard_state_over`` :mod:`treeopt._zero` adds the
data-parallel axes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from treeopt._specs import check_axes, flat_param_specs, state_leaf_specs
from treeopt._zero import zero_plan
from treeopt.layout import ParamLayout


def state_specs(
    opt_state: Any,
    layout: ParamLayout,
    param_specs: Mapping[str, PartitionSpec],
    *,
    shard_state_over: str | Sequence[str] | None = None,
    mesh: Any = None,
) -> Any:
    """A tree shaped like ``opt_state`` with a ``PartitionSpec`` at every leaf.

    ``opt_state`` is the optax state over the flat ``{name: param}`` dict
    (concrete, or abstract from ``jax.eval_shape``); ``param_specs`` is
    ``{name: spec}`` for every trainable param. With ``shard_state_over``
    (mesh axis names, and the ``mesh`` whose sizes they have) the param-owned
    leaves are also split over those axes (ZeRO-1, see :func:`zero_plan`).
    """
    if shard_state_over is None:
        treedef, leaves = state_leaf_specs(opt_state, layout, param_specs)
        return jax.tree_util.tree_unflatten(treedef, [leaf.spec for leaf in leaves])
    treedef, plan = zero_plan(opt_state, layout, param_specs, shard_state_over, mesh)
    return jax.tree_util.tree_unflatten(treedef, [leaf.zero_spec for leaf in plan.leaves])


def optimizer_state_specs(
    opt_state: Any,
    layout: ParamLayout,
    param_specs: Any,
    *,
    shard_state_over: str | Sequence[str] | None = None,
    mesh: Any = None,
) -> Any:
    """The specs of ``opt_state`` from a params-shaped tree of specs, checked; what ``partition_specs`` returns.

    ``param_specs`` is any params-shaped tree (or the flat dict) of
    ``PartitionSpec``/``None``, checked by :func:`flat_param_specs`; with a
    ``mesh`` each spec's axes are also checked against it (the error names the
    parameter). ``shard_state_over``: see :func:`zero_plan`.
    """
    flat = flat_param_specs(param_specs, layout)
    if mesh is not None:
        for name, spec in flat.items():
            check_axes(spec, mesh, f"PartitionSpec of parameter '{name}'")
    return state_specs(opt_state, layout, flat, shard_state_over=shard_state_over, mesh=mesh)
