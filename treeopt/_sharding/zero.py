"""ZeRO-1: an optimizer's state split over the data-parallel mesh axes too, with a report of each leaf.

On top of the specs :mod:`treeopt._sharding.specs` derives from the params' specs,
each floating-point leaf that belongs to a parameter also gets the
data-parallel axes (``shard_state_over``), on its largest dimension that is
not split yet and that their size divides (:func:`zero_leaf_spec`);
:class:`ZeroReport` records, leaf by leaf, the dimension chosen or why there
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

from treeopt._sharding.specs import (
    Shape,
    axis_names_of,
    lowbit_role,
    spec_of_entries,
    state_leaf_specs,
)
from treeopt._tree.layout import ParamLayout

NOT_PARAM_OWNED = "not param-owned"
NOT_FLOATING = "not floating point"
ALREADY_USES_AXIS = "already uses the axis"
NO_FREE_DIMENSION = "every dimension already sharded"
TOO_SMALL = "too small"
NOT_DIVISIBLE = "not divisible"


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
) -> ZeroLeafSpec:
    """``(spec, dim, reason)``: ``spec`` with ``axes`` added on one unsharded dimension they divide.

    The axes already in ``spec`` are not added again; the others go together on
    the largest unsharded dimension that the product of their sizes divides (the
    first of equal ones), among ``dims`` when given. Otherwise ``spec`` is
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
    """
    used = {name for entry in spec for name in axis_names_of(entry)}
    add = tuple(a for a in axes if a not in used)
    if not add:
        return ZeroLeafSpec(spec, None, ALREADY_USES_AXIS)
    if not shape or math.prod(shape) == 0:
        return ZeroLeafSpec(spec, None, TOO_SMALL)
    padded = (*spec, *([None] * (len(shape) - len(spec))))
    free = [d for d in range(len(shape)) if padded[d] is None and (dims is None or d in dims)]
    if not free:
        return ZeroLeafSpec(spec, None, NO_FREE_DIMENSION)
    n = math.prod(axis_sizes[a] for a in add)
    fits = [d for d in free if shape[d] >= n and shape[d] % n == 0]
    if not fits:
        return ZeroLeafSpec(spec, None, TOO_SMALL if max(shape[d] for d in free) < n else NOT_DIVISIBLE)
    dim = max(fits, key=lambda d: (shape[d], -d))
    entries = list(padded)
    entries[dim] = add[0] if len(add) == 1 else add
    return ZeroLeafSpec(spec_of_entries(entries), dim, None)


def zero_plan(
    parts: Mapping[str, Any],
    layout: ParamLayout,
    param_specs: Mapping[str, PartitionSpec],
    shard_state_over: str | Sequence[str],
    mesh: Any,
) -> tuple[dict[str, Any], ZeroReport]:
    """ZeRO-1: ``({part: treedef}, report)``, the report holding each leaf's spec with and without.

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
    for part, tree in parts.items():
        treedefs[part], leaves = state_leaf_specs(tree, layout, param_specs)
        codes_dims: dict[tuple[Any, ...], int | None] = {}  # a low-bit leaf's codes: the dimension split
        shapes = {leaf.path: tuple(np.shape(leaf.leaf)) for leaf in leaves}  # a codes leaf reads its scales'
        for path, leaf, param, spec in leaves:
            shape = tuple(getattr(leaf, "shape", ()))
            dtype = getattr(leaf, "dtype", None)
            reason: str | None
            role = lowbit_role(path)
            if param is None:
                zero_spec, dim, reason = spec, None, NOT_PARAM_OWNED
            elif role == "scales":  # follows its codes, so that every device holds whole blocks
                codes_dim = codes_dims.get(path[:-1])
                zero_spec, dim, reason = zero_leaf_spec(
                    shape, spec, axes, sizes, dims=() if codes_dim is None else (codes_dim,)
                )
            elif role == "codes":
                scales = shapes[(*path[:-1], jax.tree_util.GetAttrKey("scales"))]
                zero_spec, dim, reason = zero_leaf_spec(
                    shape, spec, axes, sizes, dims=_whole_block_dims(shape, scales, axes, sizes)
                )
                codes_dims[path[:-1]] = dim
            elif dtype is None or not jax.numpy.issubdtype(dtype, jax.numpy.inexact):
                zero_spec, dim, reason = spec, None, NOT_FLOATING
            else:
                zero_spec, dim, reason = zero_leaf_spec(shape, spec, axes, sizes)
            where = part + jax.tree_util.keystr(path)
            out.append(ZeroLeaf(where, param, shape, dtype, spec, zero_spec, dim, reason))
    return treedefs, ZeroReport(axes, sizes, tuple(out))


def _whole_block_dims(codes: Shape, scales: Shape, axes: Sequence[str], sizes: Mapping[str, int]) -> list[int]:
    """The dimensions of low-bit codes that a shard can take without cutting a block.

    Blocks run along the last axis, so every other dimension will do; the last
    one only when its blocks are of one length and their number divides by the
    shards' (the scales are then split on it too).
    """
    n = math.prod(sizes[a] for a in axes)
    dims = list(range(len(codes) - 1))
    if codes and scales and codes[-1] % scales[-1] == 0 and scales[-1] % n == 0:
        dims.append(len(codes) - 1)
    return dims
