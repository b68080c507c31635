"""Logical axes of an optax state from the params' logical axes, for any optax state.

T5X keeps a table of optax state types (``OptaxStatePartitionRules._RULES``)
and raises for every other type. Here the params-shaped parts of a state are
found by structure (a node with the params' tree structure, possibly with
``optax.MaskedNode`` or per-parameter sub-trees at the parameters' places),
and each of their leaves gets a spec derived from shapes with
:func:`treeopt.partitioning.derive_spec`: the param's spec where the leaf is
shaped like it, the spec minus the reduced axes for factored leaves
(Adafactor's ``v_row``/``v_col``), one entry per vector for per-dimension
lists (SM3). Everything outside those parts (counts, keys, hyperparameters) is
``None``. A rule put in ``_RULES`` for a state type still takes precedence.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import optax
from flax.core import FrozenDict, unfreeze
from jax.sharding import PartitionSpec
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from treeopt.errors import TreeMismatchError
from treeopt.internal import derive_spec, flat_param_specs, is_spec, per_dimension_axes
from treeopt.layout import ParamLayout

KeyPath = tuple[Any, ...]
Shape = tuple[int, ...]


def _entry(key: Any) -> Any:
    if isinstance(key, DictKey):
        return key.key
    if isinstance(key, SequenceKey):
        return key.idx
    if isinstance(key, GetAttrKey):
        return key.name
    if isinstance(key, FlattenedIndexKey):
        return key.key
    return str(key)


def key_path(path: Any) -> KeyPath:
    """A ``jax.tree_util`` key path as plain keys (dict keys, indices, attribute names).

    Example:
        >>> import jax
        >>> [key_path(p) for p, _ in jax.tree_util.tree_flatten_with_path({"a": [1, 2]})[0]]
        [('a', 0), ('a', 1)]
    """
    return tuple(_entry(k) for k in path)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _plain(x: Any) -> Any:
    return unfreeze(x) if isinstance(x, (dict, FrozenDict)) else x


class ParamAxes:
    """The params' logical axes by key path, their shapes where known, and what is params-shaped.

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> axes = ParamAxes({"w": P("embed", "mlp")}, {("w",): (2, 3)})
        >>> axes.is_params({"w": jnp.ones((2, 3))}), axes.is_params({"count": 0})
        (True, False)
    """

    def __init__(self, params_axes: Any, shapes: Mapping[KeyPath, Shape] | None = None):
        if is_spec(params_axes):
            raise ValueError(
                "Logical axes must be shaped like the params tree (e.g. {'w': P('embed', 'mlp')}), "
                f"got a single {params_axes}."
            )
        entries = jax.tree_util.tree_flatten_with_path(params_axes, is_leaf=is_spec)[0]
        bad = [f"{jax.tree_util.keystr(p)}: {type(s).__name__}" for p, s in entries if not is_spec(s)]
        if bad:
            raise TypeError(
                "Logical axes must have a PartitionSpec (or None, replicated) at each parameter, got "
                + ", ".join(bad)
            )
        self.specs: dict[KeyPath, PartitionSpec | None] = {key_path(p): s for p, s in entries}
        self.treedef: Any = jax.tree.structure(_plain(params_axes), is_leaf=is_spec)
        self.shapes: dict[KeyPath, Shape] = dict(shapes or {})

    def is_params(self, x: Any) -> bool:
        """Whether ``x`` has the params' structure (sub-trees allowed at the parameters' places)."""
        if not isinstance(x, (dict, FrozenDict, list, tuple)) or _is_namedtuple(x):
            return False
        try:
            self.treedef.flatten_up_to(_plain(x))
        except (ValueError, TypeError):
            return False
        return True

    def owner(self, path: KeyPath) -> KeyPath | None:
        """The parameter a leaf at ``path`` (relative to a params-shaped node) belongs to."""
        for end in range(len(path), -1, -1):
            if path[:end] in self.specs:
                return path[:end]
        return None

    def infer_shapes(self, nodes: list[Any]) -> None:
        """Shapes of the params without one, from leaves sitting at their places with a full-rank spec."""
        seen: dict[KeyPath, set[Shape]] = defaultdict(set)
        for node in nodes:
            for path, leaf in jax.tree_util.tree_flatten_with_path(node)[0]:
                param = key_path(path)
                spec = self.specs.get(param)
                shape = getattr(leaf, "shape", None)
                if spec is not None and shape is not None and len(shape) == len(spec):
                    seen[param].add(tuple(shape))
        for param, shapes in seen.items():
            if param not in self.shapes and len(shapes) == 1:
                self.shapes[param] = next(iter(shapes))

    def node_axes(self, node: Any) -> Any:
        """``node`` (params-shaped) with a spec, or ``None``, at each of its leaves."""
        leaves = [(key_path(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(node)[0]]
        groups: dict[KeyPath, list[tuple[KeyPath, Shape]]] = defaultdict(list)
        for path, leaf in leaves:
            param = self.owner(path)
            if param is not None:
                groups[param].append((path[len(param) :], tuple(getattr(leaf, "shape", ()))))

        def one(path: Any, leaf: Any) -> Any:
            keys = key_path(path)
            param = self.owner(keys)
            if param is None:
                return None
            spec = self.specs[param]
            if spec is None:
                return None
            shape = tuple(getattr(leaf, "shape", ()))
            param_shape = self.shapes.get(param)
            if param_shape is None:
                return spec if keys == param and len(shape) == len(spec) else None
            per_dim = per_dimension_axes(groups[param], param_shape)
            if per_dim is not None:
                axis = per_dim[keys[len(param) :]]
                return (
                    PartitionSpec(spec[axis])
                    if axis < len(spec) and spec[axis] is not None
                    else PartitionSpec()
                )
            return derive_spec(param_shape, spec, shape)

        return jax.tree_util.tree_map_with_path(one, node)


def state_axes(
    optax_state: Any,
    params_axes: Any,
    shapes: Mapping[KeyPath, Shape] | None = None,
    rules: Mapping[type, Callable[[Any, Any], Any]] | None = None,
) -> Any:
    """``optax_state`` with a logical spec (or ``None``) at each leaf; see the module docstring.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> from jax.sharding import PartitionSpec as P
        >>> state = optax.sgd(0.1, momentum=0.9).init({"w": jnp.ones((2, 3))})
        >>> state_axes(state, {"w": P("embed", "mlp")})[0] == optax.TraceState({"w": P("embed", "mlp")})
        True
    """
    axes = ParamAxes(params_axes, shapes)
    rules = rules or {}

    def is_leaf(x: Any) -> bool:
        return type(x) in rules or axes.is_params(x)

    flat, treedef_ = jax.tree_util.tree_flatten(optax_state, is_leaf=is_leaf)
    treedef: Any = treedef_
    kinds = ["rule" if type(x) in rules else "params" if axes.is_params(x) else "other" for x in flat]
    axes.infer_shapes([x for x, kind in zip(flat, kinds, strict=True) if kind == "params"])
    out = []
    for x, kind in zip(flat, kinds, strict=True):
        if kind == "rule":
            out.append(rules[type(x)](x, params_axes))
        elif kind == "params":
            out.append(axes.node_axes(x))
        else:
            out.append(None)
    return treedef.unflatten(out)


def axes_like(tree: Any, params_axes: Any) -> Any:
    """``params_axes`` in the structure of ``tree`` (its containers: ``FrozenDict`` or ``dict``).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax.core import FrozenDict
        >>> from jax.sharding import PartitionSpec as P
        >>> axes = axes_like(FrozenDict({"w": jnp.ones(2)}), {"w": P("embed")})
        >>> type(axes).__name__, axes["w"] == P("embed")
        ('FrozenDict', True)
    """
    specs = ParamAxes(params_axes).specs
    missing = []

    def one(path: Any, leaf: Any) -> Any:
        keys = key_path(path)
        if keys not in specs:
            missing.append("/".join(map(str, keys)))
            return None
        return specs[keys]

    out = jax.tree_util.tree_map_with_path(one, tree)
    if missing:
        raise missing_axes_error(missing)
    return out


def check_logical_axes(target: Any, param_logical_axes: Any) -> None:
    """Refuses axes the core's ``partition_specs`` refuses: unexpected entries, specs longer than the rank.

    The core's own check (the same errors, naming each path): missing and
    unexpected entries in one ``TreeMismatchError``, a spec with more entries
    than its param has axes in a ``ValueError``.

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> try:
        ...     check_logical_axes({"w": jnp.ones(3)}, {"w": P("embed"), "zz": P()})
        ... except TreeMismatchError as e:
        ...     print(str(e).splitlines()[0], e.report.unexpected)
        param_logical_axes do not match the optimizer target: ('zz',)
    """
    flat_param_specs(
        param_logical_axes, ParamLayout.of(target), what="param_logical_axes", against="the optimizer target"
    )


def missing_axes_error(missing: list[str]) -> TreeMismatchError:
    """The error for ``param_logical_axes`` without an entry for the parameters ``missing``.

    Example:
        >>> print(missing_axes_error(["dense/bias"]))
        param_logical_axes do not match the optimizer target:
        missing (1):
          dense/bias
        It must be shaped like the target, with a PartitionSpec (or None) at each parameter.
    """
    return TreeMismatchError.between(
        "param_logical_axes do not match the optimizer target",
        missing=missing,
        hint="It must be shaped like the target, with a PartitionSpec (or None) at each parameter.",
    )


def shapes_of(params: Any) -> dict[KeyPath, Shape]:
    """``{key path: shape}`` of the array leaves of ``params`` (arrays or ``ShapeDtypeStruct``s).

    Example:
        >>> import jax.numpy as jnp
        >>> shapes_of({"w": jnp.ones((2, 3)), "n": None})
        {('w',): (2, 3)}
    """
    return {
        key_path(p): tuple(leaf.shape)
        for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype")
    }


def _scale_by_schedule_ctor(state: Any, params_axes: Any) -> optax.ScaleByScheduleState:
    """T5X's rule for ``ScaleByScheduleState``: its count is replicated."""
    del state, params_axes
    return optax.ScaleByScheduleState(count=None)


class OptaxStatePartitionRules:
    """Logical axes of an optax state from the params' logical axes (T5X's classmethods).

    T5X derives them from a table of optax state types and raises for any
    other; here every optax state works (factored ones, combinators, contrib):
    the params-shaped parts are found by structure and each entry's spec is
    derived from shapes. A rule registered in ``_RULES`` (``{state type:
    fn(state, params_axes)}``), as T5X lets you add, takes precedence for its type.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> from jax.sharding import PartitionSpec as P
        >>> state = optax.adam(0.1).init({"w": jnp.ones((2, 3))})
        >>> axes = OptaxStatePartitionRules.derive_optax_logical_axes(state, {"w": P("embed", "mlp")})
        >>> axes[0] == optax.ScaleByAdamState(None, {"w": P("embed", "mlp")}, {"w": P("embed", "mlp")})
        True
    """

    _RULES: ClassVar[dict[type, Callable[[Any, Any], Any]]] = {}

    @classmethod
    def _is_optax_state(cls, x: Any) -> bool:
        """Whether ``x`` is an optax state: a NamedTuple whose type name ends with ``State``.

        Example:
            >>> import optax
            >>> OptaxStatePartitionRules._is_optax_state(optax.EmptyState())
            True
        """
        return _is_namedtuple(x) and type(x).__name__.endswith("State")

    @classmethod
    def derive_optax_logical_axes(cls, optax_state: Any, params_axes: Any, *, params: Any = None) -> Any:
        """The state's logical axes: shaped like ``optax_state``, ``None`` where replicated.

        Args:
            optax_state: an optax state over params shaped like ``params_axes``.
            params_axes: the params' logical ``PartitionSpec``s (``None`` where replicated).
            params: the params (or their ``jax.ShapeDtypeStruct``s), optional: without
                them each param's shape is read from its state entries of full rank,
                and a factored entry of a param that has none is replicated.

        Example:
            >>> import jax.numpy as jnp, optax
            >>> from jax.sharding import PartitionSpec as P
            >>> params = {"w": jnp.ones((4, 6))}
            >>> state = optax.adafactor(1e-2, min_dim_size_to_factor=2).init(params)
            >>> axes = OptaxStatePartitionRules.derive_optax_logical_axes(
            ...     state, {"w": P("embed", "mlp")}, params=params)
            >>> axes[0].v_row == {"w": P("embed")}, axes[0].v_col == {"w": P("mlp")}
            (True, True)
        """
        shapes = shapes_of(params) if params is not None else None
        return state_axes(optax_state, params_axes, shapes, cls._RULES)

    @classmethod
    def derive_params_axes(cls, optax_params: Any, params_axes: Any) -> Any:
        """Axes of a params-shaped part of an optax state: the params' axes, ``MaskedNode`` kept.

        Example:
            >>> import optax
            >>> from jax.sharding import PartitionSpec as P
            >>> axes = OptaxStatePartitionRules.derive_params_axes(
            ...     {"a": 1.0, "b": optax.MaskedNode()}, {"a": P("x"), "b": P("y")})
            >>> axes == {"a": P("x"), "b": optax.MaskedNode()}
            True
        """
        treedef: Any = jax.tree.structure(params_axes, is_leaf=is_spec)
        parts = treedef.flatten_up_to(optax_params)
        axes = treedef.flatten_up_to(params_axes)
        return treedef.unflatten(
            [part if isinstance(part, optax.MaskedNode) else ax for part, ax in zip(parts, axes, strict=True)]
        )
