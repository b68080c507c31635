"""Partition specs for the optax state of any transformation, from the params' specs.

treeopt runs ``tx.init`` on the flat dict ``{name: param}``, so every
params-shaped part of the optax state is a dict keyed by parameter names. A
state leaf therefore belongs to parameter ``X`` when its key path goes through
``DictKey(X)`` of such a dict; no table of optax state types is needed. The
spec of a leaf of ``X`` then follows from shapes alone:

- shaped like ``X``: ``X``'s spec, unchanged;
- any other shape: each axis of the leaf that can only be one axis of ``X``
  (matched in order; the other axes of ``X`` removed or reduced to size 1, as
  in Adafactor's ``v_row``/``v_col`` or SM3's accumulators) keeps that axis'
  entry; an axis that could come from more than one axis of ``X`` with
  different entries (a square matrix), or from none, is replicated;
- a list of one vector per dimension of ``X`` (SM3's ``mu``): vector ``i``
  takes entry ``i``;
- a stack of copies of ``X`` (extra leading axes, e.g. L-BFGS memories): the
  leading axes replicated, the rest as ``X``;
- everything else (counts, scalars, RNG keys, hyperparameters, ``(1,)``
  placeholders, leaves outside any params dict): ``P()``.

A spec derived this way only ever maps a leaf axis to a param axis of the same
size, so it divides the mesh exactly when the param's spec does. Empty nodes
(``optax.MaskedNode``, ``optax.EmptyState``, ``None``) stay where they are.

ZeRO-1 (``shard_state_over``), which adds the data-parallel axes on top of
these specs, is :mod:`treeopt._sharding.zero`.
"""

from __future__ import annotations

import abc
import functools
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import PartitionSpec
from jax.tree_util import SequenceKey

from treeopt._tree.layout import ParamLayout
from treeopt._tree.paths import named_leaves, param_owners
from treeopt.errors import TreeMismatchError

Shape = tuple[int, ...]
Entry = Any  # one PartitionSpec entry: None, a mesh/logical axis name, a tuple of names, UNCONSTRAINED


def is_spec(x: Any) -> bool:
    """A leaf of a spec tree: a ``PartitionSpec`` or ``None``.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> is_spec(P("data")), is_spec(None), is_spec(("data",))
        (True, True, False)
    """
    return x is None or isinstance(x, PartitionSpec)


def spec_leaves_with_names(tree: Any) -> list[tuple[str, Any]]:
    """``[(name, spec)]`` for a tree of ``PartitionSpec``/``None`` leaves, named like params.

    Names follow :func:`treeopt.leaf_names`: ``"/"``-joined keys, with the
    ``value`` of an nnx ``Variable`` dropped. ``None`` and ``PartitionSpec`` are
    leaves here (jax would drop ``None`` as an empty node).

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> named = spec_leaves_with_names({"dense": {"kernel": P(None, "model"), "bias": None}})
        >>> [(name, spec if spec is None else tuple(spec)) for name, spec in named]
        [('dense/bias', None), ('dense/kernel', (None, 'model'))]
    """
    return named_leaves(tree, is_leaf=is_spec)


def flat_param_specs(
    param_specs: Any,
    layout: ParamLayout,
    *,
    what: str = "param_specs",
    against: str = "the params this optimizer was initialized with",
) -> dict[str, PartitionSpec]:
    """``{name: spec}`` for every trainable param, checked against ``layout``.

    ``param_specs`` is shaped like params (any container: nested dicts, a
    FrozenDict, an nnx state, or the flat ``{name: spec}`` dict itself) with
    ``PartitionSpec`` or ``None`` (replicated) leaves. Specs of leaves that are
    not trained are accepted and ignored. Raises ``ValueError`` naming the paths
    that are missing or unexpected, or whose spec has more entries than the
    param has axes; ``TypeError`` for a leaf that is not a spec. ``what`` and
    ``against`` name the two trees in the messages (T5X checks its
    ``param_logical_axes`` against the optimizer target here too).

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> layout = ParamLayout.of({"w": jnp.ones((2, 3))})
        >>> try:
        ...     flat_param_specs({"w": P("data"), "zz": P()}, layout)
        ... except TreeMismatchError as e:
        ...     print(e.report.unexpected)
        ('zz',)
    """
    if isinstance(param_specs, optax.LookaheadParams):
        param_specs = param_specs.fast
    if param_specs is None:
        raise TypeError(
            f"{what} is None: expected a tree of PartitionSpecs shaped like params (e.g. "
            "{'dense': {'kernel': P(None, 'model')}}). To read them from sharded params, pass "
            "treeopt.partitioning.param_specs_of(params); init_sharded reads them itself when given None."
        )
    single = layout.treedef.num_nodes == 1 and layout.treedef.num_leaves == 1
    if isinstance(param_specs, PartitionSpec) and single:  # params that are one bare array: its spec
        return _checked_lengths({layout.names[0]: param_specs} if layout.names else {}, layout, what)
    if isinstance(param_specs, PartitionSpec):
        raise TypeError(
            f"{what} must be a tree of PartitionSpecs shaped like params "
            f"(e.g. {{'dense': {{'kernel': P(None, 'model')}}}}), got a single {param_specs}."
        )
    named = spec_leaves_with_names(param_specs)
    bad_types = [f"'{name}': {type(spec).__name__}" for name, spec in named if not is_spec(spec)]
    if bad_types:
        raise TypeError(
            f"{what} must have a PartitionSpec (or None, replicated) at each parameter, got:\n  "
            + "\n  ".join(bad_types)
        )
    given = dict(named)
    known = set(layout.all_names)
    missing = [name for name in layout.names if name not in given]
    unexpected = [name for name, _ in named if name not in known]
    if missing or unexpected:
        raise TreeMismatchError.between(
            f"{what} do not match {against}",
            missing=missing,
            unexpected=unexpected,
            hint=f"Expected a tree shaped like params, with a PartitionSpec at each of {list(layout.names)}.",
        )
    return _checked_lengths(given, layout, what)


def _checked_lengths(given: dict[str, Any], layout: ParamLayout, what: str) -> dict[str, PartitionSpec]:
    """``{name: spec}`` of the trained params (``None`` read as replicated), none longer than its param's rank."""
    out = {}
    too_long = []
    for name, (shape, _) in zip(layout.names, layout.avals, strict=True):
        spec = given[name]
        spec = PartitionSpec() if spec is None else spec
        if len(spec) > len(shape):
            too_long.append(
                f"'{name}': {spec} has {len(spec)} entries, but the parameter has "
                f"{len(shape)} axes (shape {shape})"
            )
        out[name] = spec
    if too_long:
        raise ValueError("PartitionSpec longer than the parameter's rank:\n  " + "\n  ".join(too_long))
    return out


# -- shape matching --------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _embeddings(param: Shape, leaf: Shape) -> frozenset[tuple[int | None, ...]]:
    """Every way ``leaf`` arises from ``param`` by removing axes or reducing them to size 1.

    Each result maps leaf axis ``j`` to the param axis it keeps (in order), or
    to ``None`` for a param axis reduced to size 1.
    """
    found: set[tuple[int | None, ...]] = set()

    def walk(i: int, j: int, acc: tuple[int | None, ...]) -> None:
        if len(param) - i < len(leaf) - j:
            return
        if i == len(param):
            found.add(acc)
            return
        walk(i + 1, j, acc)  # param axis i removed
        if j < len(leaf):
            if leaf[j] == param[i]:
                walk(i + 1, j + 1, (*acc, i))  # kept
            elif leaf[j] == 1:
                walk(i + 1, j + 1, (*acc, None))  # reduced to size 1 (keepdims)

    walk(0, 0, ())
    return frozenset(found)


def spec_of_entries(entries: Sequence[Entry]) -> PartitionSpec:
    """A ``PartitionSpec`` of ``entries`` without its trailing ``None``s: ``P("data", None)`` is ``P("data")``."""
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def derive_spec(param_shape: Shape, param_spec: PartitionSpec, leaf_shape: Shape) -> PartitionSpec:
    """The spec of a state leaf of shape ``leaf_shape`` that belongs to a param, by shapes.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> tuple(derive_spec((4, 6, 8), P("data", None, "model"), (4, 6, 8)))   # same shape
        ('data', None, 'model')
        >>> tuple(derive_spec((4, 6, 8), P("data", None, "model"), (4, 8)))      # Adafactor v_col
        ('data', 'model')
        >>> tuple(derive_spec((4, 6, 8), P("data", None, "model"), (4, 6)))      # Adafactor v_row
        ('data',)
        >>> tuple(derive_spec((8, 8), P("data", "model"), (8,)))                 # which axis? replicate
        ()
        >>> tuple(derive_spec((4, 8), P("data", "model"), (1,)))                 # placeholder
        ()
    """
    if tuple(leaf_shape) == tuple(param_shape):
        return param_spec
    padded = (*param_spec, *([None] * (len(param_shape) - len(param_spec))))
    extra = len(leaf_shape) - len(param_shape)
    if extra > 0 and tuple(leaf_shape[extra:]) == tuple(param_shape):
        # A stack of copies of the param (leading history/memory axes).
        return spec_of_entries([None] * extra + list(padded))
    maps = _embeddings(tuple(param_shape), tuple(leaf_shape))
    entries: list[Entry] = []
    for j in range(len(leaf_shape)):
        sources = {m[j] for m in maps}  # param axes (None: a size-1 reduced axis) leaf axis j can be
        options = {None if axis is None else padded[axis] for axis in sources}
        entries.append(options.pop() if len(options) == 1 else None)
    return spec_of_entries(entries)


# -- mesh axes -------------------------------------------------------------------


def axis_names_of(entry: Entry) -> tuple[Any, ...]:
    """The mesh (or logical) axis names one ``PartitionSpec`` entry uses: ``()``, ``("a",)``, ``("a", "b")``."""
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def check_axes(spec: PartitionSpec, mesh: Any, where: str) -> None:
    """Raises ``ValueError`` (starting with ``where``) if ``spec`` names an axis ``mesh`` lacks."""
    unknown = [name for entry in spec for name in axis_names_of(entry) if name not in mesh.axis_names]
    if unknown:
        hint = (
            " If these are logical axis names, pass the logical-to-mesh rules (rules=...)."
            if any(isinstance(name, str) for name in unknown)
            else ""
        )
        raise ValueError(
            f"{where}: {spec} uses {unknown}, not an axis of the mesh "
            f"(its axes: {tuple(mesh.axis_names)}).{hint}"
        )


# -- the state -------------------------------------------------------------------


def per_dimension_axes(
    leaves: Sequence[tuple[tuple[Any, ...], Shape]], param_shape: Shape
) -> dict[tuple[Any, ...], int] | None:
    """``{rest of path: axis}`` when one param's state leaves are one vector per dimension, else None.

    ``leaves`` are ``(path below the param's entry, shape)``; SM3 keeps such
    vectors (one per axis, at positions ``0, 1, ...``), and each gets the spec
    entry of its axis. The positions are ints or ``jax.tree_util.SequenceKey``.

    Example:
        >>> per_dimension_axes([((0,), (4,)), ((1,), (8,))], (4, 8))
        {(0,): 0, (1,): 1}
        >>> per_dimension_axes([((0,), (4, 8))], (4, 8)) is None   # shaped like the param
        True
    """
    if len(leaves) != len(param_shape) or len(param_shape) < 2:
        return None
    axes = {}
    for rest, shape in leaves:
        if len(rest) != 1:
            return None
        i = rest[0].idx if isinstance(rest[0], SequenceKey) else rest[0]
        if not isinstance(i, int) or not 0 <= i < len(param_shape) or tuple(shape) != (param_shape[i],):
            return None
        axes[rest] = i
    return axes if len(set(axes.values())) == len(param_shape) else None


class SpecifiesItself(abc.ABC):
    """A state leaf held as a small pytree of arrays that answers for its own specs (low-bit codes and scales).

    As flax's ``AxisMetadata`` does for boxed params: the sharding wing asks
    it, rather than reading its parts by name or guessing its layout from
    their shapes. A leaf takes part by subclassing it, as a boxed param
    subclasses ``AxisMetadata``: an object that merely has methods of these
    names is an ordinary leaf.

    Example:
        >>> is_self_specified(type("Lookalike", (), {"partition_specs": None, "zero_axes": None})())
        False
    """

    __slots__ = ()

    @abc.abstractmethod
    def partition_specs(self, param_spec: PartitionSpec, axis_sizes: Mapping[str, int] | None = None) -> Any:
        """This leaf with a ``PartitionSpec`` at each of its arrays, from its parameter's spec."""

    @abc.abstractmethod
    def zero_axes(
        self, param_spec: PartitionSpec, shards: int, axis_sizes: Mapping[str, int] | None = None
    ) -> list[int]:
        """The parameter's axes a ZeRO shard of ``1 / shards`` may take for all of this leaf's arrays.

        With ``axis_sizes`` an axis the parameter's spec splits may be offered
        too, for the ZeRO axes combined with its own.
        """

    @abc.abstractmethod
    def laid_out_as_param(self) -> Any:
        """The one of its arrays that has its parameter's shape and takes its layout, or ``None``."""

    @property
    @abc.abstractmethod
    def shape(self) -> tuple[int, ...]:
        """The shape of the array the leaf stands for (what a step reads it as)."""

    @property
    @abc.abstractmethod
    def dtype(self) -> Any:
        """The dtype of the array the leaf stands for."""


def is_self_specified(x: Any) -> bool:
    """Whether ``x`` answers for its own partition specs (a :class:`SpecifiesItself`)."""
    return isinstance(x, SpecifiesItself)


class StateLeafSpec(NamedTuple):
    """One leaf of an optax state, the parameter it belongs to and its derived spec."""

    path: tuple[Any, ...]
    """Its key path in the optax state."""
    leaf: Any
    param: str | None
    """The name of the parameter that owns it, or ``None`` (counts, hyperparameters, RNG keys)."""
    spec: PartitionSpec


def state_leaf_specs(
    opt_state: Any,
    layout: ParamLayout,
    param_specs: Mapping[str, PartitionSpec],
    axis_sizes: Mapping[str, int] | None = None,
) -> tuple[Any, list[StateLeafSpec]]:
    """The treedef of ``opt_state`` and a :class:`StateLeafSpec` per leaf, in tree order.

    A leaf that answers for its own specs (:class:`SpecifiesItself`) is one
    entry, whose ``spec`` is itself with a spec at each of its arrays;
    ``axis_sizes`` (the mesh's, when known) lets it keep more of them.
    """
    shapes = {name: tuple(shape) for name, (shape, _) in zip(layout.names, layout.avals, strict=True)}
    flat, treedef = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_self_specified)
    paths = [tuple(path) for path, _ in flat]
    leaf_shapes = [tuple(getattr(leaf, "shape", ())) for _, leaf in flat]
    owners = param_owners(paths, set(shapes))

    groups: dict[tuple[Any, ...], list[tuple[tuple[Any, ...], Shape]]] = defaultdict(list)
    for path, owner, shape in zip(paths, owners, leaf_shapes, strict=True):
        if owner is not None:
            groups[path[: owner + 1]].append((path[owner + 1 :], shape))

    out: list[StateLeafSpec] = []
    for (path, leaf), owner, shape in zip(flat, owners, leaf_shapes, strict=True):
        path = tuple(path)
        if owner is None:
            spec: Any = PartitionSpec()
            if is_self_specified(leaf):
                spec = jax.tree.map(lambda _: PartitionSpec(), leaf)
            out.append(StateLeafSpec(path, leaf, None, spec))
            continue
        name = path[owner].key
        param_shape, param_spec = shapes[name], param_specs[name]
        per_dim = per_dimension_axes(groups[path[: owner + 1]], param_shape)
        if is_self_specified(leaf):
            spec = leaf.partition_specs(param_spec, axis_sizes)
        elif per_dim is not None:
            axis = per_dim[path[owner + 1 :]]
            entry = param_spec[axis] if axis < len(param_spec) else None
            spec = spec_of_entries([entry])
        else:
            spec = derive_spec(param_shape, param_spec, shape)
        out.append(StateLeafSpec(path, leaf, name, spec))
    return treedef, out
