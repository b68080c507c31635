"""Sharding an Optimizer: shardings for its state from the params' ones, and sharded init.

The specs are derived from the params' ones for any optax transformation,
with no table of state types (as :meth:`treeopt.Optimizer.partition_specs`
does). This module turns them into ``NamedSharding``s for a ``Mesh``, reads
specs from flax linen's logical partitioning, creates an optimizer whose state
is born sharded and, with ``shard_state_over="data"`` (ZeRO-1), splits the
state over the data-parallel axis too (:func:`zero_report` tells what it split).

Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, treeopt
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> from treeopt.partitioning import init_sharded, named_shardings
    >>> mesh = Mesh(np.array(jax.devices()).reshape(1, -1), ("data", "model"))
    >>> specs = {"kernel": P(None, "model"), "bias": P()}
    >>> params = jax.device_put(
    ...     {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)}, named_shardings(specs, mesh))
    >>> opt = init_sharded(treeopt.Optimizer(optax.adam(1e-3)), params, mesh, specs)
    >>> opt.opt_state[0].mu["kernel"].sharding.spec == P(None, "model")
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax.core import meta
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from treeopt._compat.deprecations import moved_names
from treeopt._optimizer.optimizer import Optimizer
from treeopt._optimizer.parts import state_parts
from treeopt._sharding.abstract import eval_shape
from treeopt._sharding.optimizer_specs import checked_param_specs, whole_leaves_of
from treeopt._sharding.specs import check_axes, is_spec
from treeopt._sharding.zero import ZeroLeaf, ZeroReport, zero_plan
from treeopt._step.viewed import over_names
from treeopt.typing import Params, ParamSpecs

__all__ = [
    "ZeroLeaf",
    "ZeroReport",
    "init_sharded",
    "logical_to_mesh_specs",
    "named_shardings",
    "optimizer_shardings",
    "optimizer_specs",
    "param_specs_of",
    "zero_report",
]

__getattr__ = moved_names(__name__)

LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]
AxisNames = str | Sequence[str]


def named_shardings(specs: Any, mesh: Mesh) -> Any:
    """``NamedSharding(mesh, spec)`` at every ``PartitionSpec`` leaf of ``specs``.

    ``specs`` is any tree of ``PartitionSpec``s: params-shaped, or
    Optimizer-shaped from :meth:`~treeopt.Optimizer.partition_specs`. ``None``
    leaves become replicated shardings. Raises ``ValueError`` naming the path of
    a spec that uses an axis the mesh does not have.

    Example:
        >>> import jax, numpy as np
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
        >>> named_shardings({"w": P("data", None), "b": None}, mesh)["w"].spec == P("data", None)
        True
        >>> named_shardings({"w": P("modle")}, mesh)
        Traceback (most recent call last):
        ...
        ValueError: PartitionSpec at ['w']: ...('modle',) uses ['modle'], not an axis of the mesh (its axes: ('data', 'model')). If these are logical axis names, pass the logical-to-mesh rules (rules=...).
    """

    def one(path: Any, spec: Any) -> Any:
        if not is_spec(spec):
            raise TypeError(
                f"Expected a PartitionSpec (or None) at {jax.tree_util.keystr(path)}, "
                f"got {type(spec).__name__}."
            )
        spec = PartitionSpec() if spec is None else spec
        where = f"PartitionSpec at {jax.tree_util.keystr(path)}"
        check_axes(spec, mesh, where)
        try:
            return NamedSharding(mesh, spec)
        except Exception as err:  # e.g. a mesh axis used twice in one spec
            raise ValueError(f"{where}: {err}") from err

    return jax.tree_util.tree_map_with_path(one, specs, is_leaf=is_spec)


def logical_to_mesh_specs(logical_specs: ParamSpecs, rules: LogicalRules) -> ParamSpecs:
    """Logical ``PartitionSpec``s (flax linen axis names) to mesh ones, with flax's rules.

    Each spec goes through ``flax.linen.logical_to_mesh_axes(spec, rules)``:
    the first rule for a logical name whose mesh axis is still free in that spec
    wins; names with no rule are replicated. ``None`` leaves stay ``None``.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> rules = [("batch", "data"), ("embed", None), ("mlp", "model")]
        >>> logical_to_mesh_specs({"wi": P("embed", "mlp")}, rules) == {"wi": P(None, "model")}
        True
    """
    import flax.linen as nn  # imported lazily: linen is only needed for logical axes

    return jax.tree.map(
        lambda spec: None if spec is None else nn.logical_to_mesh_axes(spec, list(rules)),
        logical_specs,
        is_leaf=is_spec,
    )


def param_specs_of(params: Params) -> ParamSpecs:
    """The ``PartitionSpec`` tree of ``params``, shaped like it.

    A flax ``Partitioned``/``LogicallyPartitioned`` box (``nn.with_partitioning``,
    ``nn.with_logical_partitioning``) gives its names (as ``nn.get_partition_spec``
    does: logical names for logical boxes); an array with a ``NamedSharding``
    gives that sharding's spec; any other array ``P()``; other leaves ``None``.

    Example:
        >>> import jax.numpy as jnp, flax.linen as nn
        >>> boxed = {"w": nn.LogicallyPartitioned(jnp.ones((2, 4)), ("embed", "mlp")), "b": jnp.zeros(4)}
        >>> {name: tuple(spec) for name, spec in param_specs_of(boxed).items()}
        {'b': (), 'w': ('embed', 'mlp')}
    """

    def one(x: Any) -> Any:
        if isinstance(x, meta.AxisMetadata) and hasattr(x, "get_partition_spec"):
            return x.get_partition_spec()
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.spec
        return PartitionSpec() if hasattr(x, "shape") else None

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))


def _mesh_specs(param_specs: ParamSpecs, rules: LogicalRules | None) -> ParamSpecs:
    """``param_specs`` in mesh axes: boxed params read, logical names translated by ``rules``."""
    if _has_boxes(param_specs):
        param_specs = param_specs_of(param_specs)
    if rules is not None:
        param_specs = logical_to_mesh_specs(param_specs, rules)
    return param_specs


def optimizer_specs(
    opt: Optimizer,
    param_specs: ParamSpecs,
    *,
    rules: LogicalRules | None = None,
    shard_state_over: AxisNames | None = None,
    mesh: Mesh | None = None,
) -> Optimizer:
    """:meth:`Optimizer.partition_specs`, with logical param specs translated by ``rules`` first.

    Translating the params' specs before deriving the state's keeps every state
    leaf sharded exactly like its param (no resharding in the update).

    Args:
        opt: an initialized Optimizer, or an abstract one (``jax.eval_shape(opt.init, params)``).
        param_specs: ``PartitionSpec``s shaped like params (mesh axes, or logical
            names with ``rules``), or flax-boxed params.
        rules: flax linen logical axis rules, for logical specs.
        shard_state_over: ZeRO-1: a mesh axis name (or a tuple of them) to split
            the state over as well, on top of the params' specs; needs ``mesh``.
            See :func:`zero_report` for which leaves it splits. ``None``: the
            state is laid out exactly like the params.
        mesh: the mesh, to check the specs' axes against and, with
            ``shard_state_over``, for its axis sizes.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, optax, treeopt
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> opt = treeopt.Optimizer(optax.sgd(0.1, momentum=0.9)).init({"wi": jnp.ones((2, 4))})
        >>> specs = optimizer_specs(opt, {"wi": P("embed", "mlp")}, rules=[("mlp", "model")])
        >>> specs.opt_state[0].trace["wi"] == P(None, "model")
        True
        >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
        >>> zero = optimizer_specs(opt, {"wi": P(None, "model")}, shard_state_over="data", mesh=mesh)
        >>> zero.opt_state[0].trace["wi"] == P("data", "model")
        True
    """
    return opt.partition_specs(_mesh_specs(param_specs, rules), shard_state_over=shard_state_over, mesh=mesh)


def optimizer_shardings(
    opt: Optimizer,
    param_specs: ParamSpecs,
    mesh: Mesh,
    *,
    rules: LogicalRules | None = None,
    shard_state_over: AxisNames | None = None,
) -> Optimizer:
    """An Optimizer-shaped tree of ``NamedSharding``s for ``opt``'s step and state.

    The tree carries ``opt``'s static data (its ``tx`` object): use it for the
    optimizer built from that same ``tx`` (an ``Optimizer`` of another, equal
    looking ``optax.adam(...)`` is another pytree type for ``jax.jit``).

    Args:
        opt: an initialized Optimizer, or an abstract one (``jax.eval_shape(opt.init, params)``).
        param_specs: ``PartitionSpec``s shaped like params: mesh axes, or logical
            axis names with ``rules``; or flax-boxed params (read with :func:`param_specs_of`).
        mesh: the ``jax.sharding.Mesh``.
        rules: flax linen logical axis rules (``[("embed", "data"), ("mlp", "model")]``);
            ``None`` when ``param_specs`` already name mesh axes.
        shard_state_over: ZeRO-1: the data-parallel mesh axis (or a tuple of
            axes) to split the state over as well; ``None`` lays the state out
            like the params. See :func:`zero_report`.

    Returns:
        Shardings to pass as ``in_shardings``/``out_shardings`` of ``jax.jit`` for the optimizer.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, optax, treeopt
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
        >>> opt = jax.eval_shape(treeopt.Optimizer(optax.adam(1e-3)).init, {"w": jnp.ones((4, 8))})
        >>> shardings = optimizer_shardings(opt, {"w": P("data", "model")}, mesh)
        >>> shardings.opt_state[0].nu["w"].spec == P("data", "model")
        True
        >>> zero = optimizer_shardings(opt, {"w": P()}, mesh, shard_state_over="data")
        >>> zero.opt_state[0].nu["w"].spec == P(None, "data")   # the larger dimension, 8
        True
    """
    specs = optimizer_specs(opt, param_specs, rules=rules, shard_state_over=shard_state_over, mesh=mesh)
    return named_shardings(specs, mesh)


def zero_report(
    opt: Optimizer,
    param_specs: ParamSpecs,
    mesh: Mesh,
    shard_state_over: AxisNames = "data",
    *,
    rules: LogicalRules | None = None,
) -> ZeroReport:
    """What ``shard_state_over`` does to each state leaf: the dimension it splits, or why none.

    Every floating-point state leaf that belongs to a parameter (moments,
    factored statistics, per-dimension accumulators, ...) gets the axes on its
    largest dimension that no mesh axis splits yet and that the axes' size
    divides. Leaves left as they were are listed with the reason: ``"not
    param-owned"`` (counts, hyperparameters, RNG keys), ``"already uses the
    axis"`` (e.g. FSDP params), ``"every dimension already sharded"``, ``"too
    small"`` or ``"not divisible"``.

    Args:
        opt: an initialized Optimizer, or an abstract one (``jax.eval_shape(opt.init, params)``).
        param_specs: as for :func:`optimizer_shardings`.
        mesh: the ``jax.sharding.Mesh``.
        shard_state_over: the mesh axis (or tuple of axes) the state is split over.
        rules: flax linen logical axis rules, for logical specs.

    Returns:
        A :class:`ZeroReport`: ``str()`` of it is a table; ``.sharded`` / ``.unsharded``
        list the leaves; ``.bytes_per_device(zero=...)`` the state's bytes on one device.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, optax, treeopt
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
        >>> opt = jax.eval_shape(treeopt.Optimizer(optax.adam(1e-3)).init, {"w": jnp.ones((4, 8))})
        >>> report = zero_report(opt, {"w": P()}, mesh, "data")
        >>> [(leaf.path, leaf.dim) for leaf in report.sharded]
        [("opt_state[0].mu['w']", 1), ("opt_state[0].nu['w']", 1)]
        >>> [(leaf.path, leaf.reason) for leaf in report.unsharded]
        [('opt_state[0].count', 'not param-owned')]
    """
    flat = checked_param_specs(_mesh_specs(param_specs, rules), opt.layout, mesh)
    held = state_parts(opt)
    parts = held.by_part()
    whole = whole_leaves_of(over_names(opt.tx, opt.layout), held.opt_state, opt.layout, mesh, opt.owned)
    return zero_plan(parts, opt.layout, flat, shard_state_over, mesh, whole, held.unsplit_parts())[1]


def _has_boxes(tree: Any) -> bool:
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))
    return any(isinstance(x, meta.AxisMetadata) for x in leaves)


def _unbox(tree: Any) -> Any:
    # The raw values: no sharding constraint (we are outside jit; the jitted init shards).
    def one(x: Any) -> Any:
        if isinstance(x, meta.Partitioned):
            return x.value
        return x.unbox() if isinstance(x, meta.AxisMetadata) else x

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))


def init_sharded(
    opt: Optimizer,
    params: Params,
    mesh: Mesh,
    param_specs: ParamSpecs = None,
    *,
    rules: LogicalRules | None = None,
    shard_state_over: AxisNames | None = None,
) -> Optimizer:
    """``opt.init(params)`` with the state created directly sharded (``jit(init, out_shardings=...)``).

    The state is never materialized on one device: each device computes its own
    shard of it. ``params`` should already live on the mesh (or on the host).

    Args:
        opt: an Optimizer (initialized or not; ``opt.init`` is what runs).
        params: the params, plain arrays or flax-boxed (boxes are unboxed for init).
        mesh: the ``jax.sharding.Mesh``.
        param_specs: ``PartitionSpec``s shaped like params (mesh axes, or logical
            names with ``rules``). ``None``: read from ``params`` with
            :func:`param_specs_of` (flax boxes, or the arrays' ``NamedSharding``).
        rules: flax linen logical axis rules, for logical specs.
        shard_state_over: ZeRO-1: a mesh axis (or tuple of axes) to split the
            state over as well, e.g. the data-parallel axis; each device then
            creates and holds only its slice. See :func:`zero_report`.

    Returns:
        The initialized Optimizer, its step replicated and each state leaf sharded.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np, optax, treeopt
        >>> from jax.sharding import Mesh, PartitionSpec as P
        >>> mesh = Mesh(np.array(jax.devices()).reshape(1, -1), ("data", "model"))
        >>> specs = {"w": P(None, "model")}
        >>> params = jax.device_put({"w": jnp.ones((2, 8))}, named_shardings(specs, mesh))
        >>> tx = optax.adafactor(1e-2, min_dim_size_to_factor=2)
        >>> opt = init_sharded(treeopt.Optimizer(tx), params, mesh, specs)
        >>> opt.opt_state[0].v_col["w"].sharding.spec == P("model")   # (8,): the "model" axis kept
        True
        >>> zero = init_sharded(treeopt.Optimizer(optax.adam(1e-3)), params, mesh, specs, shard_state_over="data")
        >>> zero.opt_state[0].mu["w"].sharding.spec == P("data", "model")
        True
    """
    if param_specs is None:
        param_specs = param_specs_of(params)
    elif _has_boxes(param_specs):
        param_specs = param_specs_of(param_specs)
    if _has_boxes(params):
        params = _unbox(params)
    abstract = eval_shape(opt.init, params)
    shardings = optimizer_shardings(
        abstract, param_specs, mesh, rules=rules, shard_state_over=shard_state_over
    )
    return jax.jit(opt.init, out_shardings=shardings)(params)
