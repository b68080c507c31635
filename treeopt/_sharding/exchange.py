"""The owners' exchange: whole-leaf calls' matrices brought each to its owner device, computed, and sent back.

Inside one ``shard_map`` over all the mesh's axes, each call's leaf is seen
as a stack ``(matrices, *reduction axes, *output axes)`` in its own layout
(under explicit axes the leaf's type says it; under auto axes it is taken as
ZeRO-1 lays state out). Single matrices of one shape, layout and function
arguments form one group; a stacked leaf is a group of its own, its layers
left on the devices that hold them. For each group:

1. the device's local blocks are stacked in owner order (each device's
   matrices, then zeros up to the group's ``cap``); over the axes that do not
   split the matrices each device keeps its own part of the stack (no
   traffic: those devices hold the same blocks);
2. one all-to-all over the axes that split the matrices brings each owner
   the blocks of its matrices, joined locally into whole matrices;
3. each owner runs the function on its own matrices: devices with the same
   counts share one branch of a ``lax.switch`` on the device's index, so no
   device computes padding, and nothing inside is a collective;
4. the reverse all-to-all, and an all-gather over the axes that do not split
   the leaf, put the results back in each leaf's own layout.

A function that commutes with transposition (``f(x.T) == f(x).T``, as an
orthogonalization does) lets a matrix join the group of its transpose, so a
layer's row-split and column-split matrices travel together.

Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from treeopt._sharding.whole_leaf import collected
    >>> tx = optax.contrib.muon(1e-2)
    >>> params = {"w": jnp.ones((4, 8))}
    >>> with collected() as calls:
    ...     _ = tx.update(params, tx.init(params), params)
    >>> mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    >>> layout_of(calls[0], mesh)
    ((), ())
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from treeopt._sharding.explicit import is_explicit
from treeopt._sharding.whole_leaf import Call

__all__ = ["layout_of", "owned_dim", "owned_results", "spec_of"]

Layout = tuple[tuple[str, ...], ...]
"""The mesh axes that split each dimension of an array, in order (``()``: whole)."""


def spec_of(x: Any) -> tuple[Any, ...]:
    """The ``PartitionSpec`` entries of ``x``'s type (``()`` where it names none)."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    return tuple(spec) if spec is not None else ()


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def owned_dim(shape: Sequence[int], batch_axes: Sequence[int], devices: int) -> int | None:
    """The dimension an owned leaf's state is split on, over all the mesh's axes in their order, under ZeRO-1
    on auto axes: a stacked leaf's layers where they divide, else its largest dimension they divide (the
    last of equals: the columns of a square matrix).

    Shared by the ZeRO-1 plan and the exchange: under auto axes the step cannot read where a value lies,
    so the two agree on it instead. The compiler then moves each update from there to its param's layout
    with an all-to-all and an all-gather, for a param split by rows or by columns alike. ``None``: no
    dimension divides.

    Example:
        >>> owned_dim((256, 64), (), 8), owned_dim((6, 64, 64), (0,), 8), owned_dim((8, 64, 64), (0,), 8)
        (0, 2, 0)
    """
    for dims in (tuple(batch_axes)[:1], range(len(shape))):
        fits = [d for d in dims if shape[d] % devices == 0]
        if fits:
            return max(fits, key=lambda d: (shape[d], d))
    return None


def layout_of(call: Call, mesh: Any) -> Layout | None:
    """The mesh axes splitting each of the leaf's dimensions, batch first, then reduction, then output axes;
    ``None`` where the exchange cannot take it (a batch axis after the first is split).

    Under explicit axes the leaf's type says. Under auto axes the compiler does not say where a traced
    value lies: the leaf is taken to lie where ZeRO-1 puts an owned param's state (:func:`owned_dim`, all
    the mesh's axes on one dimension), and the compiler moves it there if it lies elsewhere.
    """
    batch, reduction, output = call.axes()
    order = (*batch, *reduction, *output)
    shape = tuple(call.leaf.shape)
    if is_explicit(mesh):
        spec = list(spec_of(call.leaf)) + [None] * (len(shape) - len(spec_of(call.leaf)))
        by_dim = [_axes(spec[d]) for d in order]
    else:
        by_dim = [() for _ in order]
        dim = owned_dim(shape, batch, math.prod(mesh.shape.values()))
        if dim is not None:
            by_dim[order.index(dim)] = tuple(mesh.axis_names)
    if any(by_dim[1 : len(batch)]):
        return None
    return tuple(by_dim)


@dataclasses.dataclass
class _View:
    """A call's leaf as a stack: ``(matrices, *reduction, *output)``, a single matrix with a stack axis of one,
    transposed where that joins it to its transpose's group."""

    call: Call
    stacked: bool
    swap: bool
    layout: Layout
    """The mesh axes splitting each dimension of the stack."""
    rows: int
    """How many dimensions after the stack axis are the matrix's rows (reduction axes)."""

    def of_leaf(self) -> Any:
        batch, reduction, output = self.call.axes()
        moved = jnp.transpose(self.call.leaf, (*batch, *reduction, *output))
        if self.stacked:
            moved = moved.reshape((self.call.matrix_shape()[0], *moved.shape[len(batch) :]))
        else:
            moved = moved.reshape(moved.shape[len(batch) :])[None]
        return jnp.swapaxes(moved, 1, 2) if self.swap else moved

    def to_leaf(self, stack: Any) -> Any:
        batch, reduction, output = self.call.axes()
        order = (*batch, *reduction, *output)
        shape = tuple(self.call.leaf.shape)
        if self.swap:
            stack = jnp.swapaxes(stack, 1, 2)
        moved = stack.reshape(tuple(shape[d] for d in order))
        return jnp.transpose(moved, tuple(order.index(d) for d in range(len(shape)))).astype(
            self.call.leaf.dtype
        )


def _view(call: Call, mesh: Any) -> _View:
    batch, reduction, output = call.axes()
    layout = layout_of(call, mesh)
    assert layout is not None
    shape = tuple(call.leaf.shape)
    if batch and call.matrix_shape()[0] > 1:
        folded = tuple(a for axes in layout[: len(batch)] for a in axes)
        return _View(call, True, False, (folded, *layout[len(batch) :]), len(reduction))
    rest = layout[len(batch) :]
    view = _View(call, False, False, ((), *rest), len(reduction))
    if call.entry.transposable and len(reduction) == len(output) == 1:
        r, o = shape[reduction[0]], shape[output[0]]
        if repr(((o, r), (rest[1], rest[0]))) < repr(((r, o), rest)):
            view = _View(call, False, True, ((), rest[1], rest[0]), 1)
    return view


@dataclasses.dataclass
class _Group:
    """Calls whose matrices travel as one stack: one stacked leaf, or single matrices of one shape, layout and
    function arguments."""

    views: list[tuple[int, _View]]
    layout: Layout
    stacked: bool
    counts: list[int] = dataclasses.field(default_factory=list)
    """The number of matrices each device (in the mesh's order) computes."""
    order: list[str] = dataclasses.field(default_factory=list)
    """The mesh axes in the order the stack's first dimension is split over them, the most major first."""
    cap: int = 0
    """The stack's slots on each device, once exchanged."""

    @property
    def split(self) -> list[str]:
        """The axes that split the matrices: each dimension's, in its spec's order (major first)."""
        return [a for axes in self.layout[1:] for a in axes]

    def left(self, names: Sequence[str]) -> list[str]:
        """The mesh axes that split neither the matrices nor the stack: those devices hold the same blocks."""
        used = {a for axes in self.layout for a in axes}
        return [a for a in names if a not in used]


def _groups(calls: Sequence[Call], mesh: Any) -> list[_Group]:
    out: dict[Any, _Group] = {}
    for i, call in enumerate(calls):
        view = _view(call, mesh)
        if view.stacked:
            out[("stacked", i)] = _Group([(i, view)], view.layout, True)
            continue
        shape = tuple(call.leaf.shape)
        stack_shape = tuple(shape[d] for d in call.axes()[1] + call.axes()[2])
        if view.swap:
            stack_shape = stack_shape[::-1]
        key = (call.key(), stack_shape, view.rows, str(call.leaf.dtype), view.layout)
        if key not in out:
            out[key] = _Group([], view.layout, False)
        out[key].views.append((i, view))
    return list(out.values())


def _position(device: int, mesh: Any, order: Sequence[str]) -> int:
    """Where ``device`` (its index in the mesh's order) sits when the devices are counted over ``order``."""
    names = tuple(mesh.axis_names)
    coords = np.unravel_index(device, tuple(mesh.shape[a] for a in names))
    at = dict(zip(names, (int(c) for c in coords), strict=True))
    p = 0
    for a in order:
        p = p * mesh.shape[a] + at[a]
    return p


def _matrix_cost(view: _View) -> float:
    _, m, n = view.call.matrix_shape()
    return view.call.entry.cost(m, n)


def planned(groups: Sequence[_Group], mesh: Any, plan: Callable[..., list[list[int]]]) -> None:
    """Each group's counts per device, order and cap: a stacked leaf's layers stay where they lie, the single
    matrices are balanced around them by ``plan``."""
    sizes = dict(mesh.shape)
    names = tuple(mesh.axis_names)
    devices = math.prod(sizes.values())
    loads = [0.0] * devices
    for group in groups:
        if not group.stacked:
            continue
        view = group.views[0][1]
        group.order = [*group.layout[0], *group.left(names), *group.split]
        outer = math.prod(sizes[a] for a in group.layout[0])
        local, rest = view.call.matrix_shape()[0] // outer, devices // outer
        group.cap = -(-local // rest)
        group.counts = [
            max(0, min(group.cap, local - (_position(d, mesh, group.order) % rest) * group.cap))
            for d in range(devices)
        ]
        for d in range(devices):
            loads[d] += group.counts[d] * _matrix_cost(view)
    singles = [g for g in groups if not g.stacked]
    counts = plan([(_matrix_cost(g.views[0][1]), len(g.views)) for g in singles], devices, loads)
    for group, per_device in zip(singles, counts, strict=True):
        group.counts = per_device
        group.order = [*group.left(names), *group.split]
        group.cap = max(per_device)


def owned_results(calls: Sequence[Call], mesh: Any, plan: Callable[..., list[list[int]]]) -> list[Any]:
    """The results of ``calls``, each matrix computed by its owner (see the module doc); ``plan`` balances
    the owners (:func:`treeopt._sharding.ownership.plan`)."""
    sizes = dict(mesh.shape)
    names = tuple(mesh.axis_names)
    groups = _groups(calls, mesh)
    planned(groups, mesh, plan)
    leaves = tuple(view.of_leaf() for g in groups for _, view in g.views)
    specs = tuple(PartitionSpec(*[a or None for a in g.layout]) for g in groups for _ in g.views)
    arguments = [sorted(g.views[0][1].call.arrays().items()) for g in groups]
    arrays = tuple(tuple(_replicated(value, mesh) for _, value in given) for given in arguments)

    def local(leaves: Any, arrays: Any) -> Any:
        it = iter(leaves)
        blocks = [[next(it) for _ in g.views] for g in groups]
        stacks = [_to_owners(g, b, sizes, mesh) for g, b in zip(groups, blocks, strict=True)]
        done = _computed(groups, stacks, arrays, arguments, names)
        out: list[Any] = []
        for group, stack, given in zip(groups, done, blocks, strict=True):
            out += _from_owners(group, stack, given, sizes, mesh)
        return tuple(out)

    whole = PartitionSpec()
    # The results are replicated where the leaves are (all-gathered, or computed alike), which the
    # check cannot tell through the device-indexed branches.
    done = jax.shard_map(
        local, mesh=mesh, in_specs=(specs, jax.tree.map(lambda _: whole, arrays)), out_specs=specs, check_vma=False
    )(leaves, arrays)
    results: list[Any] = [None] * len(calls)
    views = [(i, view) for g in groups for i, view in g.views]
    for (i, view), out in zip(views, done, strict=True):
        results[i] = view.to_leaf(out)
    return results


def _to_owners(group: _Group, blocks: Sequence[Any], sizes: Mapping[str, int], mesh: Any) -> Any:
    """In the per-device program: the group's local blocks as one stack, exchanged so that each device holds
    its ``cap`` matrices whole (its own first, then zeros)."""
    names = tuple(mesh.axis_names)
    devices = len(group.counts)
    if group.stacked:
        x = blocks[0]
        rest = devices // math.prod(sizes[a] for a in group.layout[0])
        if group.cap * rest > x.shape[0]:
            x = jnp.concatenate([x, jnp.zeros((group.cap * rest - x.shape[0], *x.shape[1:]), x.dtype)])
    else:
        first = [sum(group.counts[:d]) for d in range(devices)]
        zero = jnp.zeros_like(blocks[0])
        pieces = []
        for d in sorted(range(devices), key=lambda d: _position(d, mesh, group.order)):
            mine = [blocks[first[d] + j] for j in range(group.counts[d])]
            pieces += mine + [zero] * (group.cap - len(mine))
        x = jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0]
    for a in group.left(names):
        n = x.shape[0] // sizes[a]
        x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(a) * n, n, axis=0)
    split = group.split
    if not split:
        return x
    # The barrier keeps the stack one buffer: split at the concatenation's seams, XLA's CPU backend
    # hands the all-to-all operands of mixed layouts and refuses it.
    x = jax.lax.all_to_all(jax.lax.optimization_barrier(x), tuple(split), 0, 1, tiled=True)
    local = (x.shape[1] // math.prod(sizes[a] for a in split), *x.shape[2:])
    x = x.reshape((x.shape[0], *[sizes[a] for a in split], *local))
    order, at = [0], 1
    for dim, axes in enumerate(group.layout[1:]):
        order += [*range(at, at + len(axes)), 1 + len(split) + dim]
        at += len(axes)
    x = jnp.transpose(x, order)
    whole = [x.shape[0]]
    at = 1
    for axes in group.layout[1:]:
        whole.append(math.prod(x.shape[at : at + len(axes) + 1]))
        at += len(axes) + 1
    return x.reshape(whole)


def _from_owners(
    group: _Group, x: Any, blocks: Sequence[Any], sizes: Mapping[str, int], mesh: Any
) -> list[Any]:
    """The reverse of :func:`_to_owners`: the results back in each call's local block."""
    names = tuple(mesh.axis_names)
    split = group.split
    if split:
        local = blocks[0].shape[1:]
        parts = [x.shape[0]]
        for axes, size in zip(group.layout[1:], local, strict=True):
            parts += [*[sizes[a] for a in axes], size]
        x = x.reshape(parts)
        heads, at = [], 1
        for axes in group.layout[1:]:
            heads += list(range(at, at + len(axes)))
            at += len(axes) + 1
        tails = [d for d in range(1, len(parts)) if d not in heads]
        x = jnp.transpose(x, [0, *heads, *tails])
        x = x.reshape((x.shape[0], -1, *local[1:]))
        x = jax.lax.all_to_all(x, tuple(split), 1, 0, tiled=True)
    for a in reversed(group.left(names)):
        x = jax.lax.all_gather(x, a, axis=0, tiled=True)
    if group.stacked:
        return [x[: blocks[0].shape[0]]]
    devices = len(group.counts)
    first = [sum(group.counts[:d]) for d in range(devices)]
    out: list[Any] = [None] * len(blocks)
    for p, d in enumerate(sorted(range(devices), key=lambda d: _position(d, mesh, group.order))):
        for j in range(group.counts[d]):
            out[first[d] + j] = x[p * group.cap + j][None]
    return out


def _computed(
    groups: Sequence[_Group],
    stacks: Sequence[Any],
    arrays: Any,
    arguments: Sequence[Any],
    names: tuple[str, ...],
) -> list[Any]:
    """Each group's function on the device's own matrices of its stack (whole ``(cap, ...)`` blocks).

    Devices with the same counts share one branch, picked by the device's
    index: XLA runs only the branch taken, so no device computes zeros, and
    the program's cost (its dearest branch) is the most loaded device's.
    """
    devices = len(groups[0].counts)
    vectors = [tuple(g.counts[d] for g in groups) for d in range(devices)]
    branches_for = sorted(set(vectors))

    def branch(vector: tuple[int, ...]) -> Callable[..., Any]:
        def run(stacks: Any, arrays: Any) -> Any:
            out = []
            for stack, count, given, group, argument in zip(
                stacks, vector, arrays, groups, arguments, strict=True
            ):
                if count == 0:
                    out.append(jnp.zeros_like(stack))
                    continue
                view = group.views[0][1]
                named = dict(zip([n for n, _ in argument], given, strict=True))
                mine = _on_matrices(view, stack[:count], named)
                if count < group.cap:
                    mine = jnp.concatenate(
                        [mine, jnp.zeros((group.cap - count, *stack.shape[1:]), stack.dtype)]
                    )
                out.append(mine)
            return tuple(out)

        return run

    if len(branches_for) == 1:
        return list(branch(branches_for[0])(tuple(stacks), arrays))
    which = jnp.asarray([branches_for.index(v) for v in vectors], jnp.int32)
    index = which[jax.lax.axis_index(names)]
    return list(jax.lax.switch(index, [branch(v) for v in branches_for], tuple(stacks), arrays))


def _on_matrices(view: _View, stack: Any, arrays: dict[str, Any]) -> Any:
    """The function on whole matrices ``(k, *rows, *columns)``: folded to ``(k, m, n)`` and back."""
    k = stack.shape[0]
    m = math.prod(stack.shape[1 : 1 + view.rows])
    out = view.call.on_matrices(stack.reshape(k, m, -1), arrays)
    return out.reshape(stack.shape).astype(stack.dtype)


def _replicated(x: Any, mesh: Any) -> Any:
    """``x`` replicated over ``mesh`` (under explicit axes a small array's type may name an axis)."""
    if is_explicit(mesh) and any(entry is not None for entry in spec_of(x)):
        return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec()))
    return x
