"""Whole-leaf ownership: on a mesh, each matrix of a whole-leaf computation is computed by one owner device.

A whole-leaf computation (:mod:`treeopt._sharding.whole_leaf`: Muon's
Newton-Schulz orthogonalization, a user's own orthogonalizer) on a leaf that
ZeRO-1 split makes the compiler move slices at every iteration of its loop,
and on replicated state every device repeats all of it. :func:`owning` wraps
a transformation (as ``optax.apply_if_finite`` wraps one) so that, on a mesh,
every matrix (each slice of a stacked ``(layers, m, n)`` leaf is one) gets one
owner among all the mesh's devices, chosen by cost (:func:`plan`: longest
processing time first), and :func:`owned_update` runs the update so that:

1. a first evaluation of ``tx.update`` finds the whole-leaf calls (with none,
   it is the update itself: traced once);
2. :func:`analysis` reads, from the update's program, which parameter each
   call computes from (data flow, never shape) and which calls sit inside the
   transformation's own control flow (those are computed where they are, as
   written);
3. matrices of one shape and layout are stacked, each device's local blocks
   in place, and one all-to-all per mesh axis that splits them brings each
   matrix whole to its owner (a stacked leaf's layers stay where they lie);
4. each owner runs the function on its matrices, with no collective inside;
5. the reverse all-to-alls put the results back in the leaves' own layout,
   and the evaluation that counts takes them as the calls' results.

The state keeps its ZeRO layout, so state dicts, checkpoints and restores
onto another mesh are those of any ZeRO state. Off a mesh ``tx.update`` runs
as it is.

Example:
    >>> plan([(1.0, 3), (8.0, 1)], devices=2)   # the dear matrix on device 0, the three cheap ones on 1
    [[0, 3], [1, 0]]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from treeopt._compat.optax_private import multi_steps_parts
from treeopt._sharding.exchange import layout_of, owned_results, spec_of
from treeopt._sharding.explicit import is_explicit
from treeopt._sharding.specs import is_self_specified
from treeopt._sharding.whole_leaf import Call, WholeLeafFunction, collected, intercepted
from treeopt._tree.masks import checked_globs, name_matcher
from treeopt._tree.paths import path_to_name

OwnedRules = tuple[tuple[str, bool], ...]
"""``((glob, owned), ...)``: the first glob that matches a parameter's name decides; no match: owned."""

__all__ = [
    "Found",
    "OwnedLeaf",
    "OwnedRules",
    "analysis",
    "checked_owned",
    "owned_update",
    "owners",
    "owning",
    "owns",
    "plan",
    "whole_leaves",
]


def plan(
    buckets: Sequence[tuple[float, int]], devices: int, loads: Sequence[float] | None = None
) -> list[list[int]]:
    """How many matrices of each bucket each device owns: ``[[count of device d for d] per bucket]``.

    ``buckets`` are ``(cost of one matrix, number of matrices)``; ``loads``
    the work each device already has (a stacked leaf's layers where they
    lie). Longest processing time first: the matrices, dearest first, go one
    by one to the device with the least work so far (the first of equals).

    Example:
        >>> plan([(1.0, 8)], devices=4), plan([(1.0, 3), (8.0, 1)], devices=2)
        ([[2, 2, 2, 2]], [[0, 3], [1, 0]])
    """
    load = list(loads) if loads is not None else [0.0] * devices
    out: list[list[int]] = [[0] * devices for _ in buckets]
    for b in sorted(range(len(buckets)), key=lambda b: -buckets[b][0]):
        cost, count = buckets[b]
        for _ in range(count):
            d = min(range(devices), key=lambda d: (load[d], d))
            out[b][d] += 1
            load[d] += cost
    return out


def owners(calls: Sequence[Call], devices: int) -> list[list[int]]:
    """The owner device of each matrix of each call, in the calls' order, where their layouts are not known
    (as :func:`zero_report` shows them): a stacked leaf's layers in runs over the devices in order, the single
    matrices balanced around them.

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
    out: list[list[int]] = [[] for _ in calls]
    loads = [0.0] * devices
    singles: dict[Any, list[int]] = {}
    for i, call in enumerate(calls):
        k, m, n = call.matrix_shape()
        if k > 1:
            per = -(-k // devices)
            out[i] = [j // per for j in range(k)]
            for d in out[i]:
                loads[d] += call.entry.cost(m, n)
        else:
            singles.setdefault((call.key(), m, n), []).append(i)
    groups = list(singles.values())
    costs = [calls[g[0]].entry.cost(*calls[g[0]].matrix_shape()[1:]) for g in groups]
    counts = plan([(c, len(g)) for c, g in zip(costs, groups, strict=True)], devices, loads)
    for group, per_device in zip(groups, counts, strict=True):
        slots = [d for d, count in enumerate(per_device) for _ in range(count)]
        for i, d in zip(group, slots, strict=True):
            out[i] = [d]
    return out


# -- which parameter each call computes from -------------------------------------------------------

_MARK = "_treeopt_whole_leaf_call_"


@dataclasses.dataclass(frozen=True)
class Found:
    """What the update's program says of one whole-leaf call: its parameter and whether its value can leave.

    Attributes:
        param: the parameter whose gradient the call's leaf is computed from,
            element by element (``None`` where that is no single one).
        top_level: made at the update's own level, not inside its control
            flow (``lax.cond``, loops) or a nested ``jit``.
    """

    param: str | None
    top_level: bool


def analysis(tx: Any, grads: Any, state: Any, params: Any, extra: Mapping[str, Any]) -> tuple[Found, ...]:
    """For each whole-leaf call of ``tx.update(grads, state, params, **extra)``, in order: :class:`Found`.

    The update is traced once on shapes (cached by transformation and
    shapes), each call's leaf passed through a marked identity, and the
    program is read: a value computes from a gradient when an equation takes
    it to an output of as many elements (sums, norms and broadcasts do not
    carry it). So a clipped or accumulated gradient still names its
    parameter, and a parameter of another transformation of the same shape
    is never taken for it.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> tx = optax.multi_transform({"m": optax.contrib.muon(1e-2), "a": optax.adam(1e-3)},
        ...                            {"b": "m", "a": "a", "c": "m"})
        >>> grads = {"a": jnp.ones((4, 4)), "b": jnp.ones((4, 4)), "c": jnp.ones((4, 4))}
        >>> [found.param for found in analysis(tx, grads, tx.init(grads), grads, {})]
        ['b', 'c']
    """
    abstract = jax.tree.map(_aval, (grads, state, params, dict(extra)), is_leaf=is_self_specified)
    leaves, treedef = jax.tree.flatten(abstract, is_leaf=_is_aval)
    try:
        return _analysis(tx, treedef, tuple(leaves))
    except TypeError:  # an unhashable static argument: no cache
        return _analysis.__wrapped__(tx, treedef, tuple(leaves))


def _aval(x: Any) -> Any:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
    return x


def _is_aval(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


@functools.lru_cache(maxsize=128)
def _analysis(tx: Any, treedef: Any, leaves: tuple[Any, ...]) -> tuple[Found, ...]:
    grads = jax.tree.unflatten(treedef, list(leaves))[0]
    arrays = [i for i, x in enumerate(leaves) if _is_aval(x)]
    marked: list[Call] = []

    def mark(call: Call) -> Any:
        def identity(x: Any) -> Any:
            return x

        identity.__name__ = f"{_MARK}{len(marked)}"
        marked.append(call)
        return jax.jit(identity)(call.leaf)

    def update(*values: Any) -> Any:
        filled = list(leaves)
        for i, value in zip(arrays, values, strict=True):
            filled[i] = value
        g, s, p, e = jax.tree.unflatten(treedef, filled)
        with intercepted(mark):
            return tx.update(g, s, p, **e)

    closed = jax.make_jaxpr(update)(*[leaves[i] for i in arrays])
    names = [path_to_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
    n_grads = len(names)
    taints = [frozenset({i}) if i < n_grads else frozenset() for i in range(len(arrays))]
    seen: dict[int, tuple[frozenset[int], bool]] = {}
    _walk(closed.jaxpr, taints, seen, top=True)
    out = []
    for i, call in enumerate(marked):
        taint, top = seen.get(i, (frozenset(), False))
        out.append(Found(_named(taint, names, grads, call), top))
    return tuple(out)


def _named(taint: frozenset[int], names: Sequence[str], grads: Any, call: Call) -> str | None:
    if len(taint) == 1:
        return names[next(iter(taint))]
    shaped = [i for i in sorted(taint) if tuple(jax.tree.leaves(grads)[i].shape) == tuple(call.leaf.shape)]
    return names[shaped[0]] if len(shaped) == 1 else None


def _size(v: Any) -> int:
    return math.prod(getattr(getattr(v, "aval", None), "shape", ()) or ())


def _walk(
    jaxpr: Any, taints: Sequence[frozenset[int]], seen: dict[int, Any], top: bool
) -> list[frozenset[int]]:
    """The gradients each output of ``jaxpr`` computes from, element by element; marked calls go to ``seen``."""
    env: dict[Any, frozenset[int]] = dict(zip(jaxpr.invars, taints, strict=False))
    empty: frozenset[int] = frozenset()

    def read(v: Any) -> frozenset[int]:
        return empty if hasattr(v, "val") else env.get(v, empty)  # a literal holds its value

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.params.get("name")
        if isinstance(name, str) and name.startswith(_MARK):
            seen[int(name[len(_MARK) :])] = (ins[0], top)
            env[eqn.outvars[0]] = ins[0]
            continue
        subs = _sub_jaxprs(eqn.params)
        outs: list[frozenset[int]] = [empty] * len(eqn.outvars)
        if subs:
            for sub in subs:
                offset = max(len(ins) - len(sub.invars), 0)
                inner = _walk(sub, ins[offset:], seen, top=False)
                if len(inner) == len(outs):
                    outs = [a | b for a, b in zip(outs, inner, strict=True)]
        else:
            for k, v in enumerate(eqn.outvars):
                size = _size(v)
                outs[k] = frozenset().union(
                    *[t for t, x in zip(ins, eqn.invars, strict=True) if _size(x) == size]
                )
        for v, t in zip(eqn.outvars, outs, strict=True):
            env[v] = t
    return [read(v) for v in jaxpr.outvars]


def _sub_jaxprs(params: Mapping[str, Any]) -> list[Any]:
    out = []
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns") and hasattr(inner, "invars"):
                out.append(inner)
    return out


# -- what the specs and the report see ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OwnedLeaf:
    """A parameter whose update reads its matrices whole, and the device that computes each.

    Attributes:
        param: the parameter's name (``None`` where it could not be told).
        entry: the whole-leaf function (:class:`treeopt._sharding.whole_leaf.WholeLeafFunction`).
        matrices: how many independent matrices it holds (a stacked leaf's layers).
        shape: each matrix's ``(m, n)``.
        batch_axes: the param's axes that hold its matrices side by side.
        owners: the mesh device (in the mesh's order) that computes each matrix;
            empty where the computation is not owned (``owned=`` said so, or it
            sits in the transformation's own control flow).

    Example:
        >>> from treeopt._sharding.whole_leaf import registered
        >>> leaf = OwnedLeaf("dense/kernel", registered()[0], 1, (64, 128), (), (3,))
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

    ``tx.update`` is evaluated on shapes only, on the params' shapes and
    dtypes ``avals`` (``{name: ShapeDtypeStruct}``) and ``opt_state``
    (concrete or abstract; a low-bit leaf read as the array it stands for).
    A transformation that cannot update on shapes alone (one that needs
    ``value=``) has none. ``owned``: which parameters' matrices are owned
    (:func:`owns`; ``None``: all).

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> tx = optax.contrib.muon(1e-2)
        >>> avals = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32), "b": jax.ShapeDtypeStruct((4,), jnp.float32)}
        >>> [(leaf.param, leaf.shape, leaf.owners) for leaf in whole_leaves(tx, jax.eval_shape(tx.init, avals), avals, 2)]
        [('w', (8, 4), (0,))]
    """
    state = jax.tree.map(_aval, opt_state, is_leaf=is_self_specified)
    grads = dict(avals)
    try:
        with collected() as calls:
            jax.eval_shape(lambda g, s: tx.update(g, s, g), grads, state)
        found = analysis(tx, grads, state, grads, {}) if calls else ()
    except Exception:  # an update that needs more than shapes (value=, ...): nothing found
        return []
    if len(found) != len(calls):
        found = tuple(Found(None, False) for _ in calls)
    chosen = [i for i, f in enumerate(found) if f.top_level and owns(owned, f.param)]
    assigned = dict(zip(chosen, owners([calls[i] for i in chosen], devices), strict=True))
    out = []
    for i, (call, f) in enumerate(zip(calls, found, strict=True)):
        k, m, n = call.matrix_shape()
        batch = call.axes()[0]
        out.append(OwnedLeaf(f.param, call.entry, k, (m, n), batch, tuple(assigned.get(i, ()))))
    return out


# -- the options ---------------------------------------------------------------------------------------


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


# -- the wrapper ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def owning(
    tx: optax.GradientTransformation, owned: OwnedRules | None = None, names: tuple[str, ...] | None = None
) -> optax.GradientTransformationExtraArgs:
    """``tx`` with its whole-leaf calls computed by their owners on a mesh (:func:`owned_update`).

    ``owned``: which parameters' calls are owned, by name (:func:`owns`;
    ``None``: all); given the parameters' ``names``, its globs are checked as
    ``state_bits=`` globs are (one matching nothing, or shadowed by an
    earlier one: an error).

    Example:
        >>> import optax
        >>> owning(optax.contrib.muon(1e-2), (("*", True), ("up", False)), ("up", "down"))
        Traceback (most recent call last):
        ...
        ValueError: owned: the glob 'up' comes after '*', which already decides every name it matches (['up']): it has no effect. Put the narrower glob first: owned={'up': ..., '*': ...}.
    """
    if owned is not None and names:
        checked_globs("owned", owned, names)

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> tuple[Any, Any]:
        return owned_update(tx, updates, state, params, extra, owned=owned)

    return optax.GradientTransformationExtraArgs(tx.init, update)


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
    ``None``: all). The others, and calls inside the transformation's own
    control flow, are computed as written on every device, their leaf
    gathered first under explicit axes and the result put back in its layout.
    """
    mesh = mesh_of((grads, state, params))
    if mesh is None:
        return tx.update(grads, state, params, **extra)
    multi = _with_owned_inner(tx, owned)
    if multi is not None:
        return multi.update(grads, state, params, **extra)
    with collected() as calls:
        first = tx.update(grads, state, params, **extra)
    if not calls:
        return first  # nothing read whole: this was the update
    found = analysis(tx, grads, state, params, extra)
    if len(found) != len(calls):
        found = tuple(Found(None, False) for _ in calls)
    devices = math.prod(mesh.shape.values())
    chosen = [
        i
        for i, f in enumerate(found)
        if devices > 1 and f.top_level and owns(owned, f.param) and layout_of(calls[i], mesh) is not None
    ]
    computed = (
        dict(zip(chosen, owned_results([calls[i] for i in chosen], mesh, plan), strict=True))
        if chosen
        else {}
    )
    position = iter(range(len(calls)))

    def replay(call: Call) -> Any:
        i = next(position, None)
        if i is not None and i in computed:
            return computed[i]
        return _as_written(call, mesh)

    with intercepted(replay):
        return tx.update(grads, state, params, **extra)


def _as_written(call: Call, mesh: Any) -> Any:
    """The call as written; under explicit axes on its leaf gathered whole, the result in the leaf's layout."""
    if not is_explicit(mesh) or not any(spec_of(call.leaf)):
        return call.compute()
    whole = jax.sharding.reshard(call.leaf, NamedSharding(mesh, PartitionSpec()))
    out = call.compute(whole)
    return jax.sharding.reshard(out, NamedSharding(mesh, PartitionSpec(*spec_of(call.leaf))))


def _with_owned_inner(tx: Any, owned: OwnedRules | None) -> Any:
    """For ``optax.MultiSteps``, the same accumulation around an owned inner transformation; else ``None``.

    ``MultiSteps`` runs its inner update inside a ``lax.cond``, whose values
    cannot leave the branch: the owners' work is done in there instead.
    """
    multi = getattr(tx.update, "__self__", None)
    if not isinstance(multi, optax.MultiSteps):
        return None
    parts = multi_steps_parts(multi)
    inner = owning(parts.opt, owned)
    return optax.MultiSteps(inner, *parts[1:]).gradient_transformation()


def mesh_of(tree: Any) -> Any:
    """The mesh the leaves of ``tree`` are traced on, when it has several devices or (explicit axes) a leaf's
    type names one of its axes; else ``None``."""
    for leaf in jax.tree.leaves(tree):
        try:
            sharding = getattr(jax.typeof(leaf), "sharding", None)
        except TypeError:
            continue
        mesh = getattr(sharding, "mesh", None)
        if mesh is None or getattr(mesh, "empty", True):
            continue
        if math.prod(mesh.shape.values()) > 1 or (is_explicit(mesh) and any(spec_of(leaf))):
            return mesh
    return None
