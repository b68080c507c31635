"""ZeRO-1 for T5X's logical axes: a logical axis name added to each optimizer-state leaf.

T5X's partitioner turns the logical axes that ``derive_logical_axes`` returns
into mesh axes with its ``logical_axis_rules``. To shard the optimizer state
over the data-parallel mesh axis, each state leaf that belongs to a parameter
gets a logical name that the rules map to that axis (T5X's rules map ``batch``
to ``data``), on the dimension :func:`treeopt.partitioning.zero_leaf_spec`
picks from the mesh sizes: the largest dimension not sharded already whose size
the axis divides. Leaves too small or not divisible keep their axes; the
module's logger says which, and why.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import partitioning as flax_partitioning
from jax.sharding import PartitionSpec

from treeopt.internal import zero_leaf_spec
from treeopt.t5x._base import Optimizer, OptimizerState

logger = logging.getLogger(__name__)

LogicalRules = Sequence[tuple[str, Any]]


def _mesh_axes(logical_name: Any, rules: LogicalRules | None) -> tuple[str, ...]:
    """The mesh axes the rules map ``logical_name`` to, checked."""
    if not isinstance(logical_name, str):
        raise TypeError(
            "shard_state_over must be one logical axis name that logical_axis_rules map to the "
            f"data-parallel mesh axis (e.g. 'batch'), got {logical_name!r}."
        )
    if rules is None:
        rules = flax_partitioning.get_axis_rules()
    if not rules:
        raise ValueError(
            f"shard_state_over={logical_name!r} needs the logical axis rules that map it to mesh axes: "
            "pass logical_axis_rules=... (T5X's partitioner holds them) or call inside "
            "flax.linen.partitioning.axis_rules(...)."
        )
    mesh_spec = flax_partitioning.logical_to_mesh_axes((logical_name,), rules)
    entry = mesh_spec[0] if mesh_spec else None
    axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
    if not axes:
        raise ValueError(
            f"shard_state_over={logical_name!r}: logical_axis_rules map it to no mesh axis; name the "
            "logical axis that they map to the data-parallel mesh axis (T5X's rules: 'batch' -> 'data')."
        )
    return axes


def _axis_sizes(mesh: Any, axes: tuple[str, ...], logical_name: str) -> dict[str, int]:
    if mesh is None:
        raise ValueError(
            f"shard_state_over={logical_name!r} needs the mesh (mesh=...): the sizes of its axes decide "
            "which dimension of each state leaf they divide."
        )
    sizes = {
        str(name): int(size) for name, size in dict(mesh.shape if hasattr(mesh, "shape") else mesh).items()
    }
    unknown = [a for a in axes if a not in sizes]
    if unknown:
        raise ValueError(
            f"shard_state_over={logical_name!r} maps to mesh axes {list(axes)}, but {unknown} are not axes "
            f"of the mesh (its axes: {tuple(sizes)})."
        )
    return sizes


def _padded(spec: PartitionSpec, rank: int) -> list[Any]:
    return [*spec, *([None] * (rank - len(spec)))]


def shard_state_axes(
    param_states_axes: Any,
    param_states: Any,
    shard_state_over: str,
    *,
    mesh: Any,
    logical_axis_rules: LogicalRules | None = None,
) -> Any:
    """``param_states_axes`` with ``shard_state_over`` added to each per-parameter float leaf.

    ``param_states_axes`` is the logical-axes tree ``derive_logical_axes`` built
    for ``param_states`` (same structure; a ``PartitionSpec`` at each entry
    that belongs to a parameter, ``None`` elsewhere). Entries stay as they are
    where the rules already shard the leaf over the axis, no free dimension
    fits, or the leaf is not floating point.

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> rules = [("batch", "data"), ("embed", None), ("mlp", "model")]
        >>> axes = {"mu": P("embed", "mlp"), "count": None}
        >>> state = {"mu": jnp.zeros((16, 8)), "count": jnp.zeros((), jnp.int32)}
        >>> shard_state_axes(axes, state, "batch", mesh={"data": 4, "model": 2}, logical_axis_rules=rules) == {
        ...     "count": None, "mu": P("batch", "mlp")}
        True
    """
    mesh_axes = _mesh_axes(shard_state_over, logical_axis_rules)
    sizes = _axis_sizes(mesh, mesh_axes, shard_state_over)
    rules = logical_axis_rules if logical_axis_rules is not None else flax_partitioning.get_axis_rules()
    kept: list[str] = []
    sharded = 0

    def one(path: Any, logical: Any, leaf: Any) -> Any:
        nonlocal sharded
        if not isinstance(logical, PartitionSpec) or leaf is None:
            return logical
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            return logical
        shape = tuple(np.shape(leaf))
        mesh_spec = flax_partitioning.logical_to_mesh_axes(_padded(logical, len(shape)), rules)
        mesh_spec = mesh_spec if mesh_spec is not None else PartitionSpec()
        # A logical spec names one axis a dimension (flax's rules pass a pair through unresolved):
        # the data axis may not join a sharded dimension's here.
        new_mesh_spec, dim, reason = zero_leaf_spec(shape, mesh_spec, mesh_axes, sizes, combine=False)
        name = jax.tree_util.keystr(path)
        if dim is None:
            kept.append(f"{name} {shape}: {reason}")
            return logical
        entries = _padded(logical, len(shape))
        entries[dim] = shard_state_over
        candidate = PartitionSpec(*entries)
        # The rules resolve names in their own order; keep the leaf unchanged if
        # they would not put the axes where zero_leaf_spec chose.
        resolved = flax_partitioning.logical_to_mesh_axes(entries, rules) or PartitionSpec()
        if tuple(_padded(resolved, len(shape))) != tuple(_padded(new_mesh_spec, len(shape))):
            kept.append(f"{name} {shape}: the rules would not place {shard_state_over!r} on dimension {dim}")
            return logical
        sharded += 1
        return candidate

    out = jax.tree_util.tree_map_with_path(
        one, param_states_axes, param_states, is_leaf=lambda x: x is None or isinstance(x, PartitionSpec)
    )
    logger.info(
        "ZeRO over %r (mesh axes %s): %d optimizer-state leaves sharded, %d kept%s",
        shard_state_over,
        list(mesh_axes),
        sharded,
        len(kept),
        "".join(f"\n  {line}" for line in kept),
    )
    return out


def with_zero_sharding(
    axes: Optimizer,
    optimizer: Optimizer,
    shard_state_over: str | None,
    mesh: Any,
    logical_axis_rules: LogicalRules | None,
) -> Optimizer:
    """``axes`` (what ``derive_logical_axes`` built for ``optimizer``) with ZeRO-1 applied to its state.

    ``shard_state_over=None`` returns ``axes`` as it is, and then ``mesh`` and
    ``logical_axis_rules`` must be ``None`` too: alone they would do nothing.
    The target's axes (the params') never change.

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> from treeopt.t5x import optimizers
        >>> opt_def = optimizers.adam(1e-3)
        >>> opt = opt_def.create({"w": jnp.ones((16, 8))})
        >>> axes = opt_def.derive_logical_axes(opt, {"w": P("embed", "mlp")})
        >>> rules = [("batch", "data"), ("embed", None), ("mlp", "model")]
        >>> zero = with_zero_sharding(axes, opt, "batch", {"data": 4, "model": 2}, rules)
        >>> zero.state.param_states[0].mu["w"] == P("batch", "mlp"), zero.target["w"] == P("embed", "mlp")
        (True, True)
    """
    if shard_state_over is None:
        if mesh is not None or logical_axis_rules is not None:
            raise TypeError(
                "mesh=... and logical_axis_rules=... only take effect with shard_state_over=...; pass "
                "shard_state_over='batch' (the logical axis the rules map to the data axis) or drop them."
            )
        return axes
    param_states = shard_state_axes(
        axes.state.param_states,
        optimizer.state.param_states,
        shard_state_over,
        mesh=mesh,
        logical_axis_rules=logical_axis_rules,
    )
    return axes.replace(state=OptimizerState(axes.state.step, param_states))


def zero_sharded(derive: Callable[[Any, Optimizer, Any], Optimizer]) -> Callable[..., Optimizer]:
    """``derive_logical_axes(optimizer, param_logical_axes)`` with ZeRO-1's keywords, for every definition.

    The method it decorates derives the logical axes; the one it returns also
    takes ``shard_state_over``, ``mesh`` and ``logical_axis_rules`` (keyword
    only, all ``None`` by default) and applies :func:`with_zero_sharding`.

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> from treeopt.t5x import optimizers
        >>> opt_def = optimizers.adam(1e-3)
        >>> list(inspect.signature(type(opt_def).derive_logical_axes).parameters)[3:]
        ['shard_state_over', 'mesh', 'logical_axis_rules']
        >>> opt = opt_def.create({"w": jnp.ones((16, 8))})
        >>> zero = opt_def.derive_logical_axes(opt, {"w": P("embed", "mlp")}, shard_state_over="batch",
        ...     mesh={"data": 4}, logical_axis_rules=[("batch", "data"), ("embed", None), ("mlp", None)])
        >>> zero.state.param_states[0].mu["w"] == P("batch", "mlp")
        True
    """

    own = inspect.signature(derive)
    optimizer_name = list(own.parameters)[1]  # T5X's own name for it (Adafactor: optimizer_state)

    @functools.wraps(derive)
    def derive_logical_axes(
        self: Any,
        *args: Any,
        shard_state_over: str | None = None,
        mesh: Any = None,
        logical_axis_rules: LogicalRules | None = None,
        **kwargs: Any,
    ) -> Optimizer:
        optimizer = own.bind(self, *args, **kwargs).arguments[optimizer_name]
        axes = derive(self, *args, **kwargs)
        return with_zero_sharding(axes, optimizer, shard_state_over, mesh, logical_axis_rules)

    zero = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
        for name, annotation in (("shard_state_over", "str | None"), ("mesh", "Any"), ("logical_axis_rules", "Any"))
    ]
    signature = own.replace(parameters=[*own.parameters.values(), *zero])
    derive_logical_axes.__signature__ = signature  # type: ignore[attr-defined]
    return derive_logical_axes
