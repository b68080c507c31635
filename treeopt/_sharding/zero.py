"""ZeRO-1: an optimizer's state split over the data-parallel mesh axes too, with a report of each leaf.

On top of the specs :mod:`treeopt._sharding.specs` derives from the params' specs,
each floating-point leaf that belongs to a parameter also gets the
data-parallel axes (``shard_state_over``), on its largest dimension that is
not split yet and that their size divides, or else joined to the mesh axes of
a split dimension (:func:`zero_leaf_spec`); :class:`ZeroReport` records, leaf by leaf, the dimension chosen or why there
was none.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec

from treeopt._sharding.exchange import owned_dim
from treeopt._sharding.explicit import is_explicit
from treeopt._sharding.specs import (
    Shape,
    axis_names_of,
    is_self_specified,
    spec_of_entries,
    state_leaf_specs,
)
from treeopt._tree.layout import ParamLayout

NOT_PARAM_OWNED = "not param-owned"
NOT_FLOATING = "not floating point"
KEPT_WHOLE = "its state child is never split"
ALREADY_USES_AXIS = "already uses the axis"
NO_FREE_DIMENSION = "every dimension already sharded"
TOO_SMALL = "too small"
NOT_DIVISIBLE = "not divisible"
CUTS_BLOCKS = "a shard would cut its low-bit blocks"


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
            ``"already uses the axis"``, ``"every dimension already sharded"``
            (where the axes may not join a sharded dimension's, as T5X's
            logical axes may not), ``"too small"`` (no dimension as large as
            the axes, scalars and placeholders included), ``"not divisible"``
            or ``"a shard would cut its low-bit blocks"`` (4-bit codes whose
            blocks span the rows a shard could take), ``"its state child is
            never split"`` (its child's declaration, :mod:`treeopt._tree.children`).

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
    owned: tuple[Any, ...] = ()
    """The params whose update reads matrices whole, each with the device that computes each matrix
    (:class:`treeopt._sharding.ownership.OwnedLeaf`)."""

    def work_balance(self) -> float | None:
        """The most loaded device's whole-leaf work over the mean device's (1.0: even); ``None`` without any."""
        devices = math.prod(self.axis_sizes.values())
        work = [0.0] * devices
        for leaf in self.owned:
            for d in leaf.owners:
                work[d] += leaf.cost
        total = sum(work)
        return max(work) / (total / devices) if total else None

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
        if self.owned:
            balance = self.work_balance()
            shown = f"; work max/mean {balance:.2f}" if balance is not None else ""
            lines.append(f"owned, one device a matrix ({len(self.owned)} params{shown}):")
            name_width = max(len(str(leaf.param)) for leaf in self.owned)
            for owned in self.owned:
                m, n = owned.shape
                held = f"{owned.matrices} x ({m}, {n})" if owned.matrices > 1 else f"({m}, {n})"
                where = _devices(owned.owners) if owned.owners else "every device (not owned)"
                lines.append(f"  {owned.param!s:<{name_width}}  {held:<16} {where}  ({owned.what})")
        return "\n".join(lines)


def _devices(owners: Sequence[int]) -> str:
    """``"device 3"``, ``"devices 0-7"``, ``"devices 0, 2, 5"``."""
    found = sorted(set(owners))
    if len(found) == 1:
        return f"device {found[0]}"
    if found == list(range(found[0], found[-1] + 1)):
        return f"devices {found[0]}-{found[-1]}"
    return "devices " + ", ".join(str(d) for d in found)


def _n_leaves(n: int) -> str:
    return f"{n} leaf" if n == 1 else f"{n} leaves"


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError  # pragma: no cover


class ZeroLeafSpec(NamedTuple):
    """What :func:`zero_leaf_spec` decided for one leaf.

    Attributes:
        spec: the leaf's ``PartitionSpec`` with the axes added, or the one given.
        dim: the dimension that got the axes, or ``None``.
        reason: why no dimension got them (``None`` when one did); the reasons
            of :class:`ZeroLeaf`.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> spec, dim, reason = ZeroLeafSpec(P("data"), 0, None)
        >>> dim
        0
    """

    spec: PartitionSpec
    dim: int | None
    reason: str | None


def zero_leaf_spec(
    shape: Shape,
    spec: PartitionSpec,
    axes: Sequence[str],
    axis_sizes: Mapping[str, int],
    dims: Sequence[int] | None = None,
    *,
    combine: bool = True,
) -> ZeroLeafSpec:
    """``(spec, dim, reason)``: ``spec`` with ``axes`` added on one dimension they divide.

    The axes already in ``spec`` are not added again; the others go together on
    the largest unsharded dimension that the product of their sizes divides (the
    first of equal ones), among ``dims`` when given. Where no unsharded
    dimension takes them and ``combine`` is true, they join the mesh axes of a
    sharded dimension that the product of all their sizes divides (a row-split
    kernel ``P("model", None)`` gets ``P(("model", "data"), None)``): each
    device's slice of the state then lies within its slice of the param, so
    the step reads its grads without moving them. Otherwise ``spec`` is
    returned unchanged, with why.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> sizes = {"data": 4, "model": 2}
        >>> zero_leaf_spec((16, 8), P(None, "model"), ["data"], sizes) == (P("data", "model"), 0, None)
        True
        >>> zero_leaf_spec((6, 8), P(), ["data"], sizes).dim      # 8 is divisible, 6 is not
        1
        >>> zero_leaf_spec((6, 10), P(), ["data"], sizes).reason
        'not divisible'
        >>> zero_leaf_spec((16,), P("data"), ["data"], sizes) == (P("data"), None, "already uses the axis")
        True
        >>> zero_leaf_spec((64, 6), P("model", None), ["data"], sizes) == (P(("model", "data")), 0, None)
        True
        >>> zero_leaf_spec((64,), P("model"), ["data"], sizes, combine=False).reason
        'every dimension already sharded'
    """
    used = {name for entry in spec for name in axis_names_of(entry)}
    add = tuple(a for a in axes if a not in used)
    if not add:
        return ZeroLeafSpec(spec, None, ALREADY_USES_AXIS)
    if not shape or math.prod(shape) == 0:
        return ZeroLeafSpec(spec, None, TOO_SMALL)
    padded = (*spec, *([None] * (len(shape) - len(spec))))
    offered = [d for d in range(len(shape)) if dims is None or d in dims]
    free = [d for d in offered if padded[d] is None]
    sharded = [d for d in offered if padded[d] is not None and combine]
    if not free and not sharded:
        return ZeroLeafSpec(spec, None, NO_FREE_DIMENSION)
    n = math.prod(axis_sizes[a] for a in add)
    parts = {d: n * math.prod(axis_sizes.get(a, 0) for a in axis_names_of(padded[d])) for d in free + sharded}
    fits = [d for d in free if shape[d] >= n and shape[d] % n == 0]
    if fits:
        dim = max(fits, key=lambda d: (shape[d], -d))
        entry: Any = add[0] if len(add) == 1 else add
    else:
        # The per-device slice of a sharded dimension, largest first: fewer, longer rows to gather.
        fits = [d for d in sharded if parts[d] and shape[d] >= parts[d] and shape[d] % parts[d] == 0]
        if not fits:
            small = all(shape[d] < parts[d] for d in free + sharded)
            return ZeroLeafSpec(spec, None, TOO_SMALL if small else NOT_DIVISIBLE)
        dim = max(fits, key=lambda d: (shape[d] // parts[d], -d))
        entry = (*axis_names_of(padded[dim]), *add)
    entries = list(padded)
    entries[dim] = entry
    return ZeroLeafSpec(spec_of_entries(entries), dim, None)


def zero_plan(
    parts: Mapping[str, Any],
    layout: ParamLayout,
    param_specs: Mapping[str, PartitionSpec],
    shard_state_over: str | Sequence[str],
    mesh: Any,
    whole: Sequence[Any] = (),
    unsplit: frozenset[str] = frozenset(),
) -> tuple[dict[str, Any], ZeroReport]:
    """ZeRO-1: ``({part: treedef}, report)``, the report holding each leaf's spec with and without.

    ``whole`` are the params whose update reads matrices whole
    (:class:`treeopt._sharding.ownership.OwnedLeaf`): a stacked one's state
    is split along its layers where they divide, so each owner holds its
    matrices whole, and the report lists their owners. ``unsplit``: the
    parts whose state children are declared never split (``StateChild.zero``).

    ``parts`` are the parts of an optimizer's state by name (``{"opt_state":
    ..., "master": ...}``). Every floating-point leaf that belongs to a
    parameter (its moments, factored statistics, per-dimension accumulators,
    master copy, ...) gets the axes of ``shard_state_over`` on one dimension by
    :func:`zero_leaf_spec`, on top of the spec derived from its parameter's.
    The other leaves keep that spec: counts, hyperparameters and RNG keys stay
    ``P()``.
    """
    axes = zero_axes(shard_state_over, mesh)
    sizes = {name: int(size) for name, size in dict(mesh.shape).items()}
    treedefs, out = {}, []
    shapes = {name: tuple(shape) for name, (shape, _) in zip(layout.names, layout.avals, strict=True)}
    planned = {part: state_leaf_specs(tree, layout, param_specs, sizes)[1] for part, tree in parts.items()}
    layers = {
        leaf.param: list(leaf.batch_axes) for leaf in whole if leaf.param is not None and leaf.batch_axes
    }
    preferred = _preferred_dims(planned, shapes, param_specs, axes, sizes, layers)
    owned = {} if is_explicit(mesh) else _owned_specs(planned, shapes, whole, sizes)
    for part, tree in parts.items():
        treedefs[part] = jax.tree.structure(tree)
        for path, leaf, param, spec in planned[part]:
            if is_self_specified(leaf):
                param_shape = shapes.get(param) if param is not None else None
                out += _self_specified(part, path, leaf, param, param_shape, param_specs, axes, sizes)
                continue
            shape = tuple(getattr(leaf, "shape", ()))
            dtype = getattr(leaf, "dtype", None)
            reason: str | None
            if param is None:
                zero_spec, dim, reason = spec, None, NOT_PARAM_OWNED
            elif dtype is None or not jax.numpy.issubdtype(dtype, jax.numpy.inexact):
                zero_spec, dim, reason = spec, None, NOT_FLOATING
            elif part in unsplit:
                zero_spec, dim, reason = spec, None, KEPT_WHOLE
            elif param in owned and shape == shapes.get(param):
                zero_spec, dim, reason = owned[param]
            else:
                zero_spec, dim, reason = zero_leaf_spec(shape, spec, axes, sizes)
                if param in preferred and shape == shapes.get(param):
                    # Shaped like its param: on the dimension the param's low-bit leaves take, so that the
                    # arithmetic between them (a master, a compensation, a moment) stays on one layout.
                    along = zero_leaf_spec(shape, spec, axes, sizes, dims=preferred[param])
                    if along.dim is not None:
                        zero_spec, dim, reason = along
            where = part + jax.tree_util.keystr(path)
            out.append(ZeroLeaf(where, param, shape, dtype, spec, zero_spec, dim, reason))
    return treedefs, ZeroReport(axes, sizes, tuple(out), tuple(whole))


def _owned_specs(
    planned: Mapping[str, Sequence[Any]],
    shapes: Mapping[str, Shape],
    whole: Sequence[Any],
    sizes: Mapping[str, int],
) -> dict[str, ZeroLeafSpec]:
    """``{param: spec}`` of the owned params on auto axes: their state shaped like them split over all the
    mesh's devices on one dimension (:func:`treeopt._sharding.exchange.owned_dim`), where the owners'
    exchange takes it to lie, since under auto axes the step cannot read a value's layout (under explicit
    axes it reads the type, and ZeRO's own rule stands). A param with low-bit state keeps ZeRO's rule: its
    codes' blocks decide where they may be split."""
    lowbit = {param for leaves in planned.values() for _, leaf, param, _ in leaves if is_self_specified(leaf)}
    names, devices = tuple(sizes), math.prod(sizes.values())
    out = {}
    for leaf in whole:
        if leaf.param is None or not leaf.owners or leaf.param in lowbit or leaf.param not in shapes:
            continue
        dim = owned_dim(shapes[leaf.param], leaf.batch_axes, devices)
        if dim is not None:
            out[leaf.param] = ZeroLeafSpec(PartitionSpec(*([None] * dim), names), dim, None)
    return out


def _preferred_dims(
    planned: Mapping[str, Sequence[Any]],
    shapes: Mapping[str, Shape],
    param_specs: Mapping[str, PartitionSpec],
    axes: Sequence[str],
    sizes: Mapping[str, int],
    layers: Mapping[str, Sequence[int]],
) -> dict[str, list[int]]:
    """``{param: [the axis its leaves take]}``: a stacked whole-leaf param's layers where they divide, and the
    axis a param's low-bit leaves may take (among its layers, if they may)."""
    shards = math.prod(sizes[a] for a in axes)
    out: dict[str, list[int]] = {}
    for param, dims in layers.items():
        chosen = zero_leaf_spec(shapes[param], param_specs[param], axes, sizes, dims=dims)
        if chosen.dim is not None:
            out[param] = [chosen.dim]
    for leaves in planned.values():
        for _, leaf, param, _ in leaves:
            if param is None or not is_self_specified(leaf) or (param in out and param not in layers):
                continue
            allowed = leaf.zero_axes(param_specs[param], shards, sizes)
            if param in out:  # a stacked param's layers, if its codes may be split there
                allowed = [a for a in allowed if a in out[param]] or allowed
            chosen = zero_leaf_spec(shapes[param], param_specs[param], axes, sizes, dims=allowed)
            if chosen.dim is not None:
                out[param] = [chosen.dim]
    return out


def _self_specified(
    part: str,
    path: tuple[Any, ...],
    leaf: Any,
    param: str | None,
    param_shape: Shape | None,
    param_specs: Mapping[str, PartitionSpec],
    axes: Sequence[str],
    sizes: Mapping[str, int],
) -> list[ZeroLeaf]:
    """The :class:`ZeroLeaf` of each array of a leaf that answers for its own specs.

    The data axes go on one axis of its parameter that the leaf says a shard
    may take for all its arrays (whole blocks and bytes), and each array takes
    the spec the leaf derives from that parameter spec: codes and scales are
    split on the same parameter axis.
    """
    before = leaf.partition_specs(param_specs[param], sizes) if param is not None else None
    after, dim = before, None
    reason: str | None = NOT_PARAM_OWNED
    if param is not None and param_shape is not None:
        param_spec = param_specs[param]
        shards = math.prod(sizes[a] for a in axes)
        allowed = leaf.zero_axes(param_spec, shards, sizes)
        chosen = zero_leaf_spec(param_shape, param_spec, axes, sizes, dims=allowed)
        reason = chosen.reason
        if chosen.dim is None and zero_leaf_spec(param_shape, param_spec, axes, sizes).dim is not None:
            reason = CUTS_BLOCKS  # the plain rule finds a dimension; the codes' blocks or bytes refuse it
        if chosen.dim is not None:
            after, dim = leaf.partition_specs(chosen.spec, sizes), chosen.dim
    out = []
    entries = jax.tree_util.tree_flatten_with_path(leaf)[0]
    before_specs = jax.tree.leaves(before, is_leaf=_is_spec) if before is not None else None
    after_specs = jax.tree.leaves(after, is_leaf=_is_spec) if after is not None else None
    for i, (child_path, array) in enumerate(entries):
        spec = before_specs[i] if before_specs is not None else PartitionSpec()
        zero_spec = after_specs[i] if after_specs is not None else spec
        where = part + jax.tree_util.keystr((*path, *child_path))
        shape, dtype = tuple(getattr(array, "shape", ())), getattr(array, "dtype", None)
        child_dim = _dim_of(zero_spec, axes) if dim is not None else None
        why = None if child_dim is not None else (reason or CUTS_BLOCKS)
        out.append(ZeroLeaf(where, param, shape, dtype, spec, zero_spec, child_dim, why))
    return out


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec)


def _dim_of(spec: PartitionSpec, axes: Sequence[str]) -> int | None:
    """The dimension of ``spec`` whose entry holds the data axes, or ``None``."""
    for d, entry in enumerate(spec):
        if set(axes) & set(axis_names_of(entry)):
            return d
    return None
