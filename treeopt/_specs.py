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

ZeRO-1 (``shard_state_over``) works on top of these specs: each
floating-point leaf that belongs to a parameter also gets the data-parallel
axes, on its largest dimension that is not split yet and that their size
divides (:func:`zero_leaf_spec`); :class:`ZeroReport` records, leaf by leaf,
the dimension chosen or why there was none.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec
from jax.tree_util import DictKey, SequenceKey

from treeopt._paths import named_leaves
from treeopt.errors import TreeMismatchError
from treeopt.layout import ParamLayout

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


def flat_param_specs(param_specs: Any, layout: ParamLayout) -> dict[str, PartitionSpec]:
    """``{name: spec}`` for every trainable param, checked against ``layout``.

    ``param_specs`` is shaped like params (any container: nested dicts, a
    FrozenDict, an nnx state, or the flat ``{name: spec}`` dict itself) with
    ``PartitionSpec`` or ``None`` (replicated) leaves. Specs of leaves that are
    not trained are accepted and ignored. Raises ``ValueError`` naming the paths
    that are missing or unexpected, or whose spec has more entries than the
    param has axes; ``TypeError`` for a leaf that is not a spec.
    """
    if isinstance(param_specs, optax.LookaheadParams):
        param_specs = param_specs.fast
    if isinstance(param_specs, PartitionSpec):
        raise TypeError(
            "partition_specs needs a tree of PartitionSpecs shaped like params "
            f"(e.g. {{'dense': {{'kernel': P(None, 'model')}}}}), got a single {param_specs}."
        )
    named = spec_leaves_with_names(param_specs)
    bad_types = [f"'{name}': {type(spec).__name__}" for name, spec in named if not is_spec(spec)]
    if bad_types:
        raise TypeError(
            "param_specs must have a PartitionSpec (or None, replicated) at each parameter, got:\n  "
            + "\n  ".join(bad_types)
        )
    given = dict(named)
    known = set(layout.all_names)
    missing = [name for name in layout.names if name not in given]
    unexpected = [name for name, _ in named if name not in known]
    if missing or unexpected:
        raise TreeMismatchError.between(
            "param_specs do not match the params this optimizer was initialized with",
            missing=missing,
            unexpected=unexpected,
            hint=f"Expected a tree shaped like params, with a PartitionSpec at each of {list(layout.names)}.",
        )
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


def _make_spec(entries: Sequence[Entry]) -> PartitionSpec:
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
        return _make_spec([None] * extra + list(padded))
    maps = _embeddings(tuple(param_shape), tuple(leaf_shape))
    entries: list[Entry] = []
    for j in range(len(leaf_shape)):
        sources = {m[j] for m in maps}  # param axes (None: a size-1 reduced axis) leaf axis j can be
        options = {None if axis is None else padded[axis] for axis in sources}
        entries.append(options.pop() if len(options) == 1 else None)
    return _make_spec(entries)


# -- the state -------------------------------------------------------------------


def _owners(paths: Sequence[tuple[Any, ...]], names: set[str]) -> list[int | None]:
    """For each key path, the position of the ``DictKey`` naming its param, or None.

    A dict counts as params-shaped when all its keys are trainable names (a
    masked dict holds a subset: its ``MaskedNode`` entries have no leaves); the
    innermost such key on the path wins.
    """
    keys_of: dict[tuple[Any, ...], set[Any]] = defaultdict(set)
    for path in paths:
        for k, key in enumerate(path):
            if isinstance(key, DictKey):
                keys_of[path[:k]].add(key.key)
    params_dicts = {prefix for prefix, keys in keys_of.items() if keys <= names}
    out: list[int | None] = []
    for path in paths:
        owner = None
        for k, key in enumerate(path):
            if isinstance(key, DictKey) and path[:k] in params_dicts:
                owner = k
        out.append(owner)
    return out


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


def _state_leaves(
    opt_state: Any, layout: ParamLayout, param_specs: Mapping[str, PartitionSpec]
) -> tuple[Any, list[tuple[tuple[Any, ...], Any, str | None, PartitionSpec]]]:
    """The treedef of ``opt_state`` and, per leaf, ``(path, leaf, owning param or None, spec)``."""
    shapes = {name: tuple(shape) for name, (shape, _) in zip(layout.names, layout.avals, strict=True)}
    flat, treedef = jax.tree_util.tree_flatten_with_path(opt_state)
    paths = [tuple(path) for path, _ in flat]
    leaf_shapes = [tuple(getattr(leaf, "shape", ())) for _, leaf in flat]
    owners = _owners(paths, set(shapes))

    groups: dict[tuple[Any, ...], list[tuple[tuple[Any, ...], Shape]]] = defaultdict(list)
    for path, owner, shape in zip(paths, owners, leaf_shapes, strict=True):
        if owner is not None:
            groups[path[: owner + 1]].append((path[owner + 1 :], shape))

    out: list[tuple[tuple[Any, ...], Any, str | None, PartitionSpec]] = []
    for (path, leaf), owner, shape in zip(flat, owners, leaf_shapes, strict=True):
        path = tuple(path)
        if owner is None:
            out.append((path, leaf, None, PartitionSpec()))
            continue
        name = path[owner].key
        param_shape, param_spec = shapes[name], param_specs[name]
        per_dim = per_dimension_axes(groups[path[: owner + 1]], param_shape)
        if per_dim is not None:
            axis = per_dim[path[owner + 1 :]]
            entry = param_spec[axis] if axis < len(param_spec) else None
            spec = _make_spec([entry])
        else:
            spec = derive_spec(param_shape, param_spec, shape)
        out.append((path, leaf, name, spec))
    return treedef, out


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
        treedef, leaves = _state_leaves(opt_state, layout, param_specs)
        return jax.tree_util.tree_unflatten(treedef, [spec for *_, spec in leaves])
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


# -- ZeRO-1: the state split over the data-parallel axes ----------------------------------

NOT_PARAM_OWNED = "not param-owned"
NOT_FLOATING = "not floating point"
ALREADY_USES_AXIS = "already uses the axis"
NO_FREE_DIMENSION = "every dimension already sharded"
TOO_SMALL = "too small"
NOT_DIVISIBLE = "not divisible"


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


def zero_axes(shard_state_over: Any, mesh: Any) -> tuple[str, ...]:
    """``shard_state_over`` as a tuple of mesh axis names, checked against ``mesh``.

    Example:
        >>> import jax, numpy as np
        >>> from jax.sharding import Mesh
        >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
        >>> zero_axes("data", mesh), zero_axes(["data", "model"], mesh)
        (('data',), ('data', 'model'))
        >>> zero_axes("dp", mesh)
        Traceback (most recent call last):
        ...
        ValueError: shard_state_over='dp': ['dp'] is not an axis of the mesh (its axes: ('data', 'model')).
    """
    if mesh is None:
        raise ValueError(
            f"shard_state_over={shard_state_over!r} needs the mesh (mesh=...): the sizes of its axes "
            "decide which dimension of each state leaf they divide."
        )
    axes = (shard_state_over,) if isinstance(shard_state_over, str) else shard_state_over
    if not isinstance(axes, (tuple, list)) or not axes or not all(isinstance(a, str) for a in axes):
        raise TypeError(
            "shard_state_over must be a mesh axis name or a non-empty tuple of them (e.g. 'data' or "
            f"('replica', 'data')), got {shard_state_over!r}."
        )
    axes = tuple(axes)
    if len(set(axes)) != len(axes):
        raise ValueError(f"shard_state_over={shard_state_over!r} names an axis twice.")
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown:
        raise ValueError(
            f"shard_state_over={shard_state_over!r}: {unknown} is not an axis of the mesh "
            f"(its axes: {tuple(mesh.axis_names)})."
        )
    return axes


def _itemsize(dtype: Any) -> int:
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:  # extended dtypes (PRNG keys)
        return int(getattr(dtype, "itemsize", 0) or 0)


def shard_bytes(shape: Shape, dtype: Any, spec: PartitionSpec, axis_sizes: Mapping[str, int]) -> int:
    """Bytes one device holds of an array of ``shape``/``dtype`` laid out by ``spec`` on a mesh.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> shard_bytes((16, 8), "float32", P("data", None), {"data": 8, "model": 2})
        64
    """
    n = 1
    padded = (*spec, *([None] * (len(shape) - len(spec))))
    for size, entry in zip(shape, padded, strict=False):
        parts = math.prod(axis_sizes[a] for a in axis_names_of(entry))
        n *= -(-size // parts)
    return n * _itemsize(dtype)


@dataclasses.dataclass(frozen=True)
class ZeroLeaf:
    """What ZeRO sharding did to one leaf of an optimizer's state.

    Attributes:
        path: where the leaf is in the optimizer, e.g. ``"opt_state[0].mu['dense/kernel']"``.
        param: the name of the parameter the leaf belongs to, or ``None``.
        shape: the leaf's shape.
        dtype: the leaf's dtype.
        spec: its ``PartitionSpec`` without ZeRO (derived from its parameter's).
        zero_spec: its ``PartitionSpec`` with ZeRO: ``spec`` with the axes added, or ``spec``.
        dim: the dimension that got the axes, or ``None`` when the leaf was left as it was.
        reason: why it was left (``None`` when sharded): ``"not param-owned"``
            (counts, hyperparameters, RNG keys), ``"not floating point"``,
            ``"already uses the axis"``, ``"every dimension already sharded"``,
            ``"too small"`` (no dimension as large as the axes, scalars and
            placeholders included) or ``"not divisible"``.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> leaf = ZeroLeaf("opt_state[0].mu['w']", "w", (16, 8), "float32", P(), P("data"), 0, None)
        >>> leaf.sharded
        True
    """

    path: str
    param: str | None
    shape: Shape
    dtype: Any
    spec: PartitionSpec
    zero_spec: PartitionSpec
    dim: int | None
    reason: str | None

    @property
    def sharded(self) -> bool:
        """Whether ZeRO added its axes to this leaf."""
        return self.dim is not None


@dataclasses.dataclass(frozen=True)
class ZeroReport:
    """Which optimizer-state leaves ZeRO sharding split, on which dimension, and why not the others.

    ``str(report)`` is a readable table; :meth:`bytes_per_device` gives the
    memory one device holds, with and without the added axes.

    Attributes:
        axes: the mesh axes the state is split over (``shard_state_over``).
        axis_sizes: the sizes of all the mesh's axes.
        leaves: one :class:`ZeroLeaf` per leaf of the state, in tree order.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> leaves = (
        ...     ZeroLeaf("opt_state[0].mu['w']", "w", (16, 8), "float32", P(), P("data"), 0, None),
        ...     ZeroLeaf("opt_state[0].count", None, (), "int32", P(), P(), None, "not param-owned"),
        ... )
        >>> report = ZeroReport(("data",), {"data": 8}, leaves)
        >>> report.bytes_per_device(zero=False), report.bytes_per_device()
        (516, 68)
        >>> [leaf.path for leaf in report.unsharded]
        ['opt_state[0].count']
    """

    axes: tuple[str, ...]
    axis_sizes: Mapping[str, int]
    leaves: tuple[ZeroLeaf, ...]

    @property
    def sharded(self) -> list[ZeroLeaf]:
        """The leaves that got the axes."""
        return [leaf for leaf in self.leaves if leaf.sharded]

    @property
    def unsharded(self) -> list[ZeroLeaf]:
        """The leaves left as they were, each with its ``reason``."""
        return [leaf for leaf in self.leaves if not leaf.sharded]

    def bytes_per_device(self, zero: bool = True) -> int:
        """Bytes of the state one device holds: with the ZeRO specs, or (``zero=False``) without."""
        return sum(
            shard_bytes(leaf.shape, leaf.dtype, leaf.zero_spec if zero else leaf.spec, self.axis_sizes)
            for leaf in self.leaves
        )

    def __str__(self) -> str:
        size = math.prod(self.axis_sizes[a] for a in self.axes)
        before, after = self.bytes_per_device(zero=False), self.bytes_per_device()
        ratio = f" (x{after / before:.3f})" if before else ""
        lines = [
            f"ZeRO over {self.axes if len(self.axes) > 1 else self.axes[0]!r} ({size} shards): "
            f"optimizer state per device {_human(before)} -> {_human(after)}{ratio}",
            f"sharded ({_n_leaves(len(self.sharded))}):",
        ]
        width = max((len(leaf.path) for leaf in self.leaves), default=0)
        for leaf in self.sharded:
            lines.append(
                f"  {leaf.path:<{width}}  {leaf.shape!s:<14} {leaf.spec} -> {leaf.zero_spec}  (dimension {leaf.dim})"
            )
        lines.append(f"not sharded ({_n_leaves(len(self.unsharded))}):")
        for leaf in self.unsharded:
            lines.append(f"  {leaf.path:<{width}}  {leaf.shape!s:<14} {leaf.spec}  {leaf.reason}")
        return "\n".join(lines)


def _n_leaves(n: int) -> str:
    return f"{n} leaf" if n == 1 else f"{n} leaves"


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError  # pragma: no cover


def zero_leaf_spec(
    shape: Shape, spec: PartitionSpec, axes: Sequence[str], axis_sizes: Mapping[str, int]
) -> tuple[PartitionSpec, int | None, str | None]:
    """``(spec, dimension, reason)``: ``spec`` with ``axes`` added on one unsharded dimension they divide.

    The axes already in ``spec`` are not added again; the others go together on
    the largest unsharded dimension that the product of their sizes divides (the
    first of equal ones). Otherwise ``spec`` is returned unchanged, with why.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> sizes = {"data": 4, "model": 2}
        >>> zero_leaf_spec((16, 8), P(None, "model"), ["data"], sizes)
        (P('data', 'model'), 0, None)
        >>> zero_leaf_spec((6, 8), P(), ["data"], sizes)           # 8 is divisible, 6 is not
        (P(None, 'data'), 1, None)
        >>> zero_leaf_spec((6, 10), P(), ["data"], sizes)
        (P(), None, 'not divisible')
        >>> zero_leaf_spec((16,), P("data"), ["data"], sizes)      # FSDP: already there
        (P('data',), None, 'already uses the axis')
    """
    used = {name for entry in spec for name in axis_names_of(entry)}
    add = tuple(a for a in axes if a not in used)
    if not add:
        return spec, None, ALREADY_USES_AXIS
    if not shape or math.prod(shape) == 0:
        return spec, None, TOO_SMALL
    padded = (*spec, *([None] * (len(shape) - len(spec))))
    free = [d for d in range(len(shape)) if padded[d] is None]
    if not free:
        return spec, None, NO_FREE_DIMENSION
    n = math.prod(axis_sizes[a] for a in add)
    fits = [d for d in free if shape[d] >= n and shape[d] % n == 0]
    if not fits:
        return spec, None, TOO_SMALL if max(shape[d] for d in free) < n else NOT_DIVISIBLE
    dim = max(fits, key=lambda d: (shape[d], -d))
    entries = list(padded)
    entries[dim] = add[0] if len(add) == 1 else add
    return _make_spec(entries), dim, None


def zero_plan(
    opt_state: Any,
    layout: ParamLayout,
    param_specs: Mapping[str, PartitionSpec],
    shard_state_over: str | Sequence[str],
    mesh: Any,
) -> tuple[Any, ZeroReport]:
    """ZeRO-1: ``(treedef of opt_state, report)``, the report holding each leaf's spec with and without.

    Every floating-point leaf that belongs to a parameter (its moments,
    factored statistics, per-dimension accumulators, ...) gets the axes of
    ``shard_state_over`` on one dimension by :func:`zero_leaf_spec`, on top of
    the spec derived from its parameter's. The other leaves keep that spec:
    counts, hyperparameters and RNG keys stay ``P()``.
    """
    axes = zero_axes(shard_state_over, mesh)
    sizes = {name: int(size) for name, size in dict(mesh.shape).items()}
    treedef, leaves = _state_leaves(opt_state, layout, param_specs)
    out = []
    for path, leaf, param, spec in leaves:
        shape = tuple(getattr(leaf, "shape", ()))
        dtype = getattr(leaf, "dtype", None)
        reason: str | None
        if param is None:
            zero_spec, dim, reason = spec, None, NOT_PARAM_OWNED
        elif dtype is None or not jax.numpy.issubdtype(dtype, jax.numpy.inexact):
            zero_spec, dim, reason = spec, None, NOT_FLOATING
        else:
            zero_spec, dim, reason = zero_leaf_spec(shape, spec, axes, sizes)
        where = "opt_state" + jax.tree_util.keystr(path)
        out.append(ZeroLeaf(where, param, shape, dtype, spec, zero_spec, dim, reason))
    return treedef, ZeroReport(axes, sizes, tuple(out))
