"""Whole-leaf ownership: on a mesh, each matrix of a whole-leaf computation is computed by one owner device.

A whole-leaf computation (:mod:`treeopt._sharding.whole_leaf`: Muon's
Newton-Schulz orthogonalization) on a leaf that ZeRO-1 split over the data
axis makes the compiler move slices at every iteration of its loop, and on
replicated state every device repeats all of it. Here every matrix (each
slice of a stacked ``(layers, m, n)`` leaf is one) gets one owner among the
mesh's devices, chosen by cost (:func:`plan`: longest processing time first
on ``max(m, n) * min(m, n) ** 2``), and :func:`owned_update` runs the
transformation's update so that:

1. a first, discarded evaluation of ``tx.update`` collects the whole-leaf
   calls and their arguments (the momenta);
2. the matrices of equal shape are stacked owner by owner (a device's
   matrices, then zeros up to the bucket's most loaded device) and the stack
   is laid out over all mesh devices: one exchange brings each matrix to its
   owner (nothing moves for a stacked leaf already split along its layers);
3. each owner orthogonalizes its matrices, with no collective inside;
4. the results go back (under explicit axes to the leaf's own layout, under
   auto axes to every device), and the evaluation of ``tx.update`` that
   counts takes them as the calls' results.

The state itself keeps its ZeRO layout (a stacked leaf's layers are split
over the data axis, so there each owner holds its matrices whole), so state
dicts, checkpoints and restores onto another mesh are those of any ZeRO
state. Off a mesh of several devices ``tx.update`` runs as it is.

Example:
    >>> plan([(1.0, 3), (8.0, 1)], devices=2)   # the dear matrix on device 0, the three cheap ones on 1
    [[0, 3], [1, 0]]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from treeopt._compat.optax_private import multi_steps_parts
from treeopt._sharding.explicit import is_explicit
from treeopt._sharding.specs import is_self_specified
from treeopt._sharding.whole_leaf import Call, WholeLeafFunction, collected, intercepted
from treeopt._tree.masks import name_matcher
from treeopt._tree.paths import path_to_name
from treeopt._tree.view import order_seen_by

OwnedRules = tuple[tuple[str, bool], ...]
"""``((glob, owned), ...)``: the first glob that matches a parameter's name decides; no match: owned."""

__all__ = [
    "Bucket",
    "OwnedLeaf",
    "OwnedRules",
    "call_names",
    "checked_owned",
    "owned_update",
    "owners",
    "owns",
    "plan",
    "whole_leaves",
]


def plan(buckets: Sequence[tuple[float, int]], devices: int) -> list[list[int]]:
    """How many matrices of each bucket each device owns: ``[[count of device d for d] per bucket]``.

    ``buckets`` are ``(cost of one matrix, number of matrices)``. Longest
    processing time first: the matrices, dearest first, go one by one to the
    device with the least work so far (the first of equals).

    Example:
        >>> plan([(1.0, 8)], devices=4), plan([(1.0, 3), (8.0, 1)], devices=2)
        ([[2, 2, 2, 2]], [[0, 3], [1, 0]])
    """
    loads = [0.0] * devices
    out: list[list[int]] = [[0] * devices for _ in buckets]
    for b in sorted(range(len(buckets)), key=lambda b: -buckets[b][0]):
        cost, count = buckets[b]
        for _ in range(count):
            d = min(range(devices), key=lambda d: (loads[d], d))
            out[b][d] += 1
            loads[d] += cost
    return out


@dataclasses.dataclass
class Bucket:
    """Calls whose matrices stack: the same function and arguments, matrix shape and dtype."""

    calls: list[tuple[int, Call]]
    """``(position among the calls, call)``."""
    shape: tuple[int, int]
    cost: float

    @property
    def count(self) -> int:
        """The number of matrices."""
        return sum(call.matrix_shape()[0] for _, call in self.calls)


def buckets_of(calls: Sequence[Call]) -> list[Bucket]:
    """The calls grouped into buckets, in the order of their first call.

    A stacked leaf (several matrices) is a bucket of its own: its layers stay
    together, and where ZeRO split them over the data axis, in place.
    """
    out: dict[Any, Bucket] = {}
    for i, call in enumerate(calls):
        k, m, n = call.matrix_shape()
        key = (call.key(), m, n, str(call.leaf.dtype)) if k == 1 else ("stacked", i)
        if key not in out:
            out[key] = Bucket([], (m, n), call.entry.cost(m, n))
        out[key].calls.append((i, call))
    return list(out.values())


def owners(calls: Sequence[Call], devices: int) -> list[list[int]]:
    """The owner device of each matrix of each call, in the calls' order: what :func:`owned_results` computes.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> from treeopt._sharding.whole_leaf import collected
        >>> tx = optax.contrib.muon(1e-2)
        >>> params = {"a": jnp.ones((4, 4)), "b": jnp.ones((4, 4)), "c": jnp.ones((8, 8))}
        >>> with collected() as found:
        ...     _ = tx.update(params, tx.init(params), params)
        >>> owners(found, devices=2)   # the dear (8, 8) on device 0, both (4, 4) on device 1
        [[1], [1], [0]]
    """
    buckets = buckets_of(calls)
    counts = plan([(b.cost, b.count) for b in buckets], devices)
    out: list[list[int]] = [[] for _ in calls]
    for bucket, per_device in zip(buckets, counts, strict=True):
        slots = [d for d, count in enumerate(per_device) for _ in range(count)]
        taken = 0
        for i, call in bucket.calls:
            k = call.matrix_shape()[0]
            out[i] = slots[taken : taken + k]
            taken += k
    return out


@dataclasses.dataclass(frozen=True)
class OwnedLeaf:
    """A parameter whose update reads its matrices whole, and the device that computes each.

    Attributes:
        param: the parameter's name (``None`` where it could not be told).
        entry: the whole-leaf computation (:data:`treeopt._sharding.whole_leaf.WHOLE_LEAF`).
        matrices: how many independent matrices it holds (a stacked leaf's layers).
        shape: each matrix's ``(m, n)``, ``m <= n``.
        batch_axes: the param's axes that hold its matrices side by side.
        owners: the mesh device (in the mesh's order) that computes each matrix;
            empty where the computation is not owned (``owned=`` said so).

    Example:
        >>> from treeopt._sharding.whole_leaf import MUON_NEWTON_SCHULZ
        >>> leaf = OwnedLeaf("dense/kernel", MUON_NEWTON_SCHULZ, 1, (64, 128), (), (3,))
        >>> leaf.what, leaf.cost
        ("Muon's Newton-Schulz orthogonalization", 524288.0)
    """

    param: str | None
    entry: WholeLeafFunction
    matrices: int
    shape: tuple[int, int]
    batch_axes: tuple[int, ...]
    owners: tuple[int, ...]

    @property
    def what(self) -> str:
        """What the computation is, for reports."""
        return self.entry.what

    @property
    def cost(self) -> float:
        """The work of one matrix, as ownership weighs it (:meth:`WholeLeafFunction.cost`)."""
        return self.entry.cost(*self.shape)


def whole_leaves(
    tx: Any,
    opt_state: Any,
    avals: Mapping[str, Any],
    devices: int,
    owned: OwnedRules | None = None,
) -> list[OwnedLeaf]:
    """The parameters whose update under ``tx`` reads matrices whole, and their owners among ``devices``.

    ``tx.update`` is evaluated on shapes only (``jax.eval_shape``), on the
    params' shapes and dtypes ``avals`` (``{name: ShapeDtypeStruct}``) and
    ``opt_state`` (concrete or abstract; a low-bit leaf read as the array it
    stands for). A transformation that cannot update on shapes alone (one
    that needs ``value=``) has none. ``owned``: which parameters' matrices are
    owned (:func:`owns`; ``None``: all).

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> tx = optax.contrib.muon(1e-2)
        >>> avals = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32), "b": jax.ShapeDtypeStruct((4,), jnp.float32)}
        >>> [(leaf.param, leaf.shape, leaf.owners) for leaf in whole_leaves(tx, jax.eval_shape(tx.init, avals), avals, 2)]
        [('w', (4, 8), (0,))]
    """
    state = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), opt_state, is_leaf=is_self_specified
    )
    try:
        with collected() as calls:
            jax.eval_shape(lambda g, s: tx.update(g, s, g), dict(avals), state)
    except Exception:  # an update that needs more than shapes (value=, ...): nothing found
        return []
    names = call_names(calls, dict(avals), order_seen_by(tx))
    chosen = [i for i, name in enumerate(names) if owns(owned, name)]
    assigned = dict(zip(chosen, owners([calls[i] for i in chosen], devices), strict=True))
    out = []
    for i, (call, name) in enumerate(zip(calls, names, strict=True)):
        k, m, n = call.matrix_shape()
        batch = call.axes()[0]
        out.append(OwnedLeaf(name, call.entry, k, (m, n), batch, tuple(assigned.get(i, ()))))
    return out


def call_names(calls: Sequence[Call], grads: Any, order: Sequence[str] | None = None) -> list[str | None]:
    """The parameter each call belongs to, read from ``grads`` (what ``tx.update`` was given).

    optax maps a whole-leaf function over the leaves in tree order, so the
    calls follow the params' names in order: each call takes the next name
    whose param has the call's leaf's shape. ``None`` where no name is left.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> from treeopt._sharding.whole_leaf import collected
        >>> tx = optax.contrib.muon(1e-2)
        >>> grads = {"dense/kernel": jnp.ones((4, 8)), "dense/bias": jnp.ones(8), "out/kernel": jnp.ones((8, 2))}
        >>> with collected() as found:
        ...     _ = tx.update(grads, tx.init(grads), grads)
        >>> call_names(found, grads)
        ['dense/kernel', 'out/kernel']
    """
    if order is not None:  # tx sees the params in the user's structure: its leaves come in that order
        named = [(name, tuple(jnp.shape(grads[name]))) for name in order]
    else:
        named = [
            (path_to_name(path), tuple(jnp.shape(leaf)))
            for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]
        ]
    out: list[str | None] = []
    at = 0
    for call in calls:
        shape = tuple(call.leaf.shape)
        while at < len(named) and named[at][1] != shape:
            at += 1
        out.append(named[at][0] if at < len(named) else None)
        at += 1
    return out


def mesh_of(tree: Any) -> Any:
    """The mesh the leaves of ``tree`` are traced on, when it has more than one device; else ``None``."""
    for leaf in jax.tree.leaves(tree):
        try:
            sharding = getattr(jax.typeof(leaf), "sharding", None)
        except TypeError:
            continue
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and not getattr(mesh, "empty", True) and math.prod(mesh.shape.values()) > 1:
            return mesh
    return None


def _spec_of(x: Any) -> tuple[Any, ...]:
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    return tuple(spec) if spec is not None else ()


def _place(x: Any, mesh: Any, spec: Sequence[Any], explicit: bool) -> Any:
    sharding = NamedSharding(mesh, PartitionSpec(*spec))
    if explicit:
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


@dataclasses.dataclass
class _Stacked:
    """One bucket laid out over the devices: a device's run of ``cap`` holds its matrices, then zeros."""

    bucket: Bucket
    per_device: list[list[tuple[int, int]]]
    """``(call, matrix)`` of each device's matrices, in stack order."""
    layout: tuple[Any, ...]
    stack: Any = None

    @property
    def cap(self) -> int:
        return max(len(mine) for mine in self.per_device)

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(len(mine) for mine in self.per_device)

    @property
    def even(self) -> bool:
        return len(set(self.counts)) == 1


def owned_results(calls: Sequence[Call], mesh: Any) -> list[Any]:
    """The results of ``calls``, each matrix computed by its owner (see the module doc)."""
    devices = math.prod(mesh.shape.values())
    explicit = is_explicit(mesh)
    assigned = owners(calls, devices)
    stacked = []
    for bucket in buckets_of(calls):
        per_device: list[list[tuple[int, int]]] = [[] for _ in range(devices)]
        for i, _ in bucket.calls:
            for j, d in enumerate(assigned[i]):
                per_device[d].append((i, j))
        layout = _spec_of(bucket.calls[0][1].matrices()) if explicit else ()
        one = _Stacked(bucket, per_device, layout)
        one.stack = _place(_stack(one, mesh, explicit), mesh, (tuple(mesh.axis_names),), explicit)
        stacked.append(one)
    outs = _orthogonalized(stacked, mesh)
    results: list[Any] = [None] * len(calls)
    for one, out in zip(stacked, outs, strict=True):
        if explicit:  # back to the leaves' own layout (under auto axes, each result below)
            out = _place(out, mesh, (None, *one.layout[1:]), True)
        position = {
            slot: d * one.cap + j for d, mine in enumerate(one.per_device) for j, slot in enumerate(mine)
        }
        for i, call in one.bucket.calls:
            k = call.matrix_shape()[0]
            at = [position[(i, j)] for j in range(k)]
            if at == list(range(at[0], at[0] + k)):
                part = jax.lax.slice_in_dim(out, at[0], at[0] + k, axis=0)
            else:
                part = jnp.concatenate([jax.lax.slice_in_dim(out, p, p + 1, axis=0) for p in at], axis=0)
            result = call.from_matrices(part).astype(call.leaf.dtype)
            if explicit:  # the bucket's layout may be another call's: each result in its own leaf's
                leaf_layout = _spec_of(call.leaf)
                results[i] = (
                    result if _spec_of(result) == leaf_layout else _place(result, mesh, leaf_layout, True)
                )
            else:
                results[i] = _place(result, mesh, _split(call, mesh), False)
    return results


def _split(call: Call, mesh: Any) -> tuple[Any, ...]:
    """Under auto axes, the layout a whole-leaf call's leaf is taken to have, as ZeRO-1 lays it out: split over
    all the mesh's devices on a batch axis they divide (a stacked leaf's layers), else on its largest
    dimension they divide (the first of equals), else whole.

    The compiler does not say where a traced value lies; ZeRO over any of the mesh's axes splits that
    dimension coarser, so taking this one from there is a local slice, not an exchange.
    """
    shape = tuple(call.leaf.shape)
    devices = math.prod(mesh.shape.values())
    batch = call.axes()[0]
    for dims in (batch, range(len(shape))):
        fits = [d for d in dims if shape[d] >= devices and shape[d] % devices == 0]
        if fits:
            dim = max(fits, key=lambda d: (shape[d], -d))
            return (*([None] * dim), tuple(mesh.axis_names))
    return ()


def _stack(one: _Stacked, mesh: Any, explicit: bool) -> Any:
    """The bucket's matrices in stack order, zeros where a device has fewer than ``cap``, in one layout."""
    m, n = one.bucket.shape
    leaves = {i: call.leaf for i, call in one.bucket.calls}
    if not explicit:
        leaves = {i: _place(call.leaf, mesh, _split(call, mesh), False) for i, call in one.bucket.calls}
    matrices = {i: call.matrices(leaves[i]) for i, call in one.bucket.calls}
    if explicit:  # one layout to stack in: the first call's (under auto axes the compiler chooses)
        matrices = {
            i: x if _spec_of(x) == one.layout else _place(x, mesh, one.layout, True)
            for i, x in matrices.items()
        }
    in_order = [slot for mine in one.per_device for slot in mine]
    if len(matrices) == 1 and one.even and in_order == sorted(in_order):
        return next(
            iter(matrices.values())
        )  # a stacked leaf in its own order: split along its layers as it is
    dtype = next(iter(matrices.values())).dtype
    pieces = []
    for mine in one.per_device:
        pieces += [jax.lax.slice_in_dim(matrices[i], j, j + 1, axis=0) for i, j in mine]
        if len(mine) < one.cap:
            zeros = jnp.zeros((one.cap - len(mine), m, n), dtype)
            pieces.append(_place(zeros, mesh, one.layout, True) if explicit else zeros)
    return jnp.concatenate(pieces, axis=0) if len(pieces) > 1 else pieces[0]


def _orthogonalized(stacked: Sequence[_Stacked], mesh: Any) -> list[Any]:
    """Each bucket's function on each device's own matrices of its stack.

    A bucket every device holds as many matrices of runs as one program on
    each device's run. The others run in one branch per device (devices with
    the same counts share one), picked by the device's index: XLA runs only
    the branch taken, so no device computes zeros, and a device's branch
    holds all its work, so the program's cost (the dearest branch) is the
    most loaded device's.
    """
    outs: list[Any] = [one.bucket.calls[0][1].on_matrices(one.stack) if one.even else None for one in stacked]
    uneven = [b for b, one in enumerate(stacked) if not one.even]
    if not uneven:
        return outs
    devices = len(stacked[0].per_device)
    vectors = [tuple(stacked[b].counts[d] for b in uneven) for d in range(devices)]
    branches_for = sorted(set(vectors))
    which = jnp.asarray([branches_for.index(vector) for vector in vectors], jnp.int32)
    axes = tuple(mesh.axis_names)
    arguments = [sorted(stacked[b].bucket.calls[0][1].arrays().items()) for b in uneven]

    def branch(vector: tuple[int, ...]) -> Callable[..., Any]:
        def run(blocks: Any, arrays: Any) -> Any:
            out = []
            for b, block, count, given in zip(uneven, blocks, vector, arrays, strict=True):
                one, call = stacked[b], stacked[b].bucket.calls[0][1]
                names = [name for name, _ in arguments[uneven.index(b)]]
                if count == 0:
                    out.append(jnp.zeros_like(block))
                    continue
                mine = call.on_matrices(
                    jax.lax.slice_in_dim(block, 0, count, axis=0), dict(zip(names, given, strict=True))
                )
                if count < one.cap:
                    mine = jnp.concatenate(
                        [mine, jnp.zeros((one.cap - count, *block.shape[1:]), block.dtype)], axis=0
                    )
                out.append(mine)
            return tuple(out)

        return run

    def local(blocks: Any, which: Any, arrays: Any) -> Any:
        index = which[jax.lax.axis_index(axes)]
        return jax.lax.switch(index, [branch(vector) for vector in branches_for], blocks, arrays)

    spec, whole = PartitionSpec(axes), PartitionSpec()
    blocks = tuple(stacked[b].stack for b in uneven)
    arrays = tuple(tuple(_replicated(value, mesh) for _, value in given) for given in arguments)
    in_specs = (tuple(spec for _ in blocks), whole, jax.tree.map(lambda _: whole, arrays))
    done = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=tuple(spec for _ in blocks))(
        blocks, which, arrays
    )
    for b, out in zip(uneven, done, strict=True):
        outs[b] = out
    return outs


def _replicated(x: Any, mesh: Any) -> Any:
    """``x`` replicated over ``mesh`` (under explicit axes a small array's type may name an axis)."""
    if is_explicit(mesh) and any(entry is not None for entry in _spec_of(x)):
        return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec()))
    return x


def checked_owned(owned: Any) -> OwnedRules:
    """The optimizer's ``owned`` option as rules by parameter name, or an error naming it and the choices.

    Example:
        >>> checked_owned(True), checked_owned({"embed/*": False})
        ((('*', True),), (('embed/*', False),))
        >>> checked_owned("yes")
        Traceback (most recent call last):
        ...
        TypeError: owned must be True, False, or a mapping {glob over parameter names: True | False}, got 'yes'.
    """
    choices = "True, False, or a mapping {glob over parameter names: True | False}"
    if isinstance(owned, bool):
        return (("*", owned),)
    if isinstance(owned, Mapping) and owned:
        bad = {
            glob: value
            for glob, value in owned.items()
            if not isinstance(glob, str) or not isinstance(value, bool)
        }
        if not bad:
            return tuple(owned.items())
        raise TypeError(f"owned must be {choices}, got the entries {bad}.")
    raise TypeError(f"owned must be {choices}, got {owned!r}.")


def owns(rules: OwnedRules | None, name: str | None) -> bool:
    """Whether a parameter's whole-leaf matrices are owned under ``rules`` (a nameless call: by the ``"*"`` rule).

    Example:
        >>> rules = (("embed/*", False), ("*", True))
        >>> owns(rules, "embed/table"), owns(rules, "dense/kernel"), owns(None, "x")
        (False, True, True)
    """
    for glob, owned in rules or ():
        if (name is None and glob == "*") or (name is not None and name_matcher(glob)(name)):
            return owned
    return True


def owned_update(
    tx: Any,
    grads: Any,
    state: Any,
    params: Any,
    extra: Mapping[str, Any],
    *,
    owned: OwnedRules | None = None,
) -> tuple[Any, Any]:
    """``tx.update(grads, state, params, **extra)`` with its whole-leaf calls computed by their owners.

    ``owned``: which parameters' calls are owned, by name (:func:`owns`;
    ``None``: all). The others are computed as optax does, on every device,
    their leaf gathered first under explicit axes (the compiler refuses
    optax's matmuls on a split one).
    """
    mesh = mesh_of(grads)
    if mesh is None:
        return tx.update(grads, state, params, **extra)
    tx = _with_owned_inner(tx, owned)
    with collected() as calls:
        tx.update(grads, state, params, **extra)
    names = call_names(calls, grads, order_seen_by(tx)) if owned is not None else [None] * len(calls)
    chosen = [i for i, name in enumerate(names) if owns(owned, name)]
    computed: dict[int, Any] = {}
    if chosen:
        try:
            computed = dict(zip(chosen, owned_results([calls[i] for i in chosen], mesh), strict=True))
        except jax.errors.UnexpectedTracerError:
            computed = {}  # calls inside the transformation's own control flow: computed where they are
    position = iter(range(len(calls)))

    def replay(call: Call) -> Any:
        i = next(position, None)
        if i is not None and i in computed:
            return computed[i]
        leaf = call.leaf
        if is_explicit(mesh):
            leaf = jax.sharding.reshard(leaf, NamedSharding(mesh, PartitionSpec()))
        return call.compute(leaf)

    with intercepted(replay):
        return tx.update(grads, state, params, **extra)


def _with_owned_inner(tx: Any, owned: OwnedRules | None) -> Any:
    """``tx``, or for ``optax.MultiSteps`` the same accumulation around an owned inner transformation.

    ``MultiSteps`` runs its inner update inside a ``lax.cond``, whose values
    cannot leave the branch: the owners' work is done in there instead.
    """
    multi = getattr(tx.update, "__self__", None)
    if not isinstance(multi, optax.MultiSteps):
        return tx
    parts = multi_steps_parts(multi)
    inner = parts.opt

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        return owned_update(inner, updates, state, params, extra, owned=owned)

    rebuilt = optax.MultiSteps(optax.GradientTransformationExtraArgs(inner.init, update), *parts[1:])
    return rebuilt.gradient_transformation()
