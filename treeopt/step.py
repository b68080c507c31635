"""One optimizer step over the flat, named state: the pure function ``Optimizer.update`` runs.

:func:`flat_step` applies ``tx.update`` to ``{name: grad}`` and ``{name:
param}`` and returns a :class:`FlatStep`. Traced inline under a JAX
transformation; called eagerly, it runs one compiled program per
transformation and shapes, so an eager step costs one dispatch.
``Optimizer.init`` also fixes the state's dtypes here (:func:`stable_dtypes`),
so that the jitted step traces once.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from treeopt._state.master import follow_params
from treeopt._state.step_rule import next_step
from treeopt._update.trace_guard import is_tracer, strong
from treeopt.typing import FlatParams

__all__ = ["FlatStep", "flat_step"]


def _narrow_float(leaf: Any) -> bool:
    """A floating leaf narrower than 32 bits (bfloat16, float16, float8): the kind arithmetic promotes."""
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact) and np.dtype(dtype).itemsize < 4


def stable_dtypes(tx: optax.GradientTransformation, opt_state: Any, flat: Any, lookahead: bool) -> Any:
    """``opt_state`` with the dtypes that ``tx.update`` gives it back.

    Some transformations return a state leaf in another dtype than ``init``
    made it (``inject_hyperparams(adamw)`` turns the ``mu`` of a bfloat16
    param into float32 through its float32 hyperparameters). Fixing the dtypes
    at init means one trace of the jitted step, and a state dict that always
    loads into ``init`` / ``eval_shape(init)``. Found by tracing updates
    (shapes only, nothing runs) until the dtypes stop changing.
    """
    if not any(_narrow_float(leaf) for leaf in jax.tree.leaves(opt_state)):
        return opt_state  # 32/64-bit state: nothing to promote, and tracing costs ~1 ms a leaf
    grads = flat.fast if lookahead else flat
    state = opt_state
    for _ in range(3):
        try:
            after = jax.eval_shape(
                functools.partial(_flat_step_traced, tx, extra_args={}, apply_updates=False),
                jnp.zeros((), jnp.int32),
                state,
                grads,
                flat,
            ).opt_state
        except Exception:  # needs extra args (value=, ...), or cannot run on zeros: keep init's
            return state
        before_leaves, treedef_ = jax.tree.flatten(state)
        after_leaves, after_def = jax.tree.flatten(after)
        treedef: Any = treedef_
        if treedef != after_def:
            return state
        changed = [
            b is not None and hasattr(b, "dtype") and a.dtype != b.dtype
            for b, a in zip(before_leaves, after_leaves, strict=True)
        ]
        if not any(changed):
            return state
        state = treedef.unflatten(
            [
                jnp.asarray(b, a.dtype) if c else b
                for b, a, c in zip(before_leaves, after_leaves, changed, strict=True)
            ]
        )
    return state


def _strong_tree(tree: Any) -> Any:
    """``tree`` with weakly typed arrays made strong: one compiled eager step for either kind."""
    leaves = tree.values() if type(tree) is dict else jax.tree.leaves(tree)
    if not any(getattr(x, "weak_type", False) for x in leaves):
        return tree
    return jax.tree.map(strong, tree)


ARRAYS = (jax.Array, np.ndarray, np.generic)
_DYNAMIC = (*ARRAYS, int, float, complex)


def _split_extra(extra: Mapping[str, Any]) -> tuple[list[Any], Any]:
    """``(array leaves, static rest)`` of the extra arguments, for the compiled eager step.

    Arrays and numbers are traced inputs; everything else (functions such as
    ``value_fn``, strings, the static data of pytree nodes) is part of the
    compile key, so it never reaches jit as an argument it cannot trace.
    """
    leaves, treedef = jax.tree.flatten(extra)
    dynamic, fixed = [], []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, _DYNAMIC):
            dynamic.append(strong(leaf))  # Python numbers stay as they are: weak on every call
        else:
            fixed.append((i, leaf))
    return dynamic, (treedef, tuple(fixed))


def _join_extra(dynamic: Sequence[Any], static: Any) -> Any:
    """The extra arguments again, from the two parts :func:`_split_extra` made."""
    treedef, fixed = static
    fixed_at = dict(fixed)
    values = iter(dynamic)
    return treedef.unflatten(
        [fixed_at[i] if i in fixed_at else next(values) for i in range(treedef.num_leaves)]
    )


class FlatStep(NamedTuple):
    """The result of :func:`flat_step`: the new step count, the new optax state, its output and masters.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> tx = optax.sgd(0.5)
        >>> params = {"w": jnp.ones(2)}
        >>> out = flat_step(tx, jnp.int32(0), tx.init(params), {"w": jnp.ones(2)}, params)
        >>> int(out.step), out.output["w"].tolist()
        (1, [0.5, 0.5])
    """

    step: jax.Array
    """The number of updates applied, incremented by one."""
    opt_state: optax.OptState
    """The optax state after the update."""
    output: Any
    """The new flat params (``apply_updates=True``) or the flat updates."""
    master: Any = None
    """The new master copies ``{name: array}`` when the step was given masters, else ``None``."""


def _flat_step_traced(
    tx: optax.GradientTransformation,
    step: Any,
    opt_state: Any,
    flat_grads: Any,
    flat_params: Any,
    extra_args: Mapping[str, Any],
    apply_updates: bool,
    master: Mapping[str, Any] | None = None,
    param_dtypes: Mapping[str, Any] | None = None,
) -> FlatStep:
    """The step itself; :func:`flat_step` decides whether it runs traced or compiled."""
    if master:
        return _master_step(
            tx, step, opt_state, flat_grads, flat_params, extra_args, apply_updates, master, param_dtypes
        )
    updates, new_state = tx.update(flat_grads, opt_state, flat_params, **extra_args)
    out = optax.apply_updates(flat_params, updates) if apply_updates else updates
    return FlatStep(next_step(step), new_state, out)


def _master_step(
    tx: optax.GradientTransformation,
    step: Any,
    opt_state: Any,
    flat_grads: Any,
    flat_params: Any,
    extra_args: Mapping[str, Any],
    apply_updates: bool,
    master: Mapping[str, Any],
    param_dtypes: Mapping[str, Any] | None,
) -> FlatStep:
    """The step on the master copies: grads cast up, ``tx`` run and applied on the masters.

    Leaves without a master are stepped as without them. The output for a
    leaf with one is its new master cast to the param's dtype, or (the
    updates) that minus the param given, in the master's dtype.
    """
    grads = {k: g.astype(master[k].dtype) if k in master else g for k, g in flat_grads.items()}
    params: dict[str, Any] | None
    if flat_params is not None:
        master = follow_params(master, flat_params)  # a param changed behind the optimizer wins
        params = {k: master[k] if k in master else p for k, p in flat_params.items()}
        dtypes = {k: flat_params[k].dtype for k in master}
    else:  # tx reads the masters, if every trained leaf has one
        params = {k: master[k] for k in flat_grads} if set(flat_grads) <= set(master) else None
        dtypes = dict(param_dtypes or {})
    updates, new_state = tx.update(grads, opt_state, params, **extra_args)
    new_master = optax.apply_updates(dict(master), {k: updates[k] for k in master})
    out = {}
    for k in flat_grads:
        if k not in master:
            out[k] = optax.apply_updates(flat_params[k], updates[k]) if apply_updates else updates[k]
        elif apply_updates:
            out[k] = new_master[k].astype(dtypes[k])
        else:
            given = flat_params[k] if flat_params is not None else master[k].astype(dtypes[k])
            out[k] = new_master[k].astype(dtypes[k]).astype(master[k].dtype) - given.astype(master[k].dtype)
    return FlatStep(next_step(step), new_state, out, new_master)


def _flat_step_joined(
    tx: optax.GradientTransformation,
    step: Any,
    opt_state: Any,
    flat_grads: Any,
    flat_params: Any,
    dynamic_extra: Sequence[Any],
    static_extra: Any,
    apply_updates: bool,
    master: Any,
    param_dtypes: tuple[tuple[str, str], ...] | None,
) -> FlatStep:
    extra = _join_extra(dynamic_extra, static_extra)
    dtypes = None if param_dtypes is None else {k: jnp.dtype(d) for k, d in param_dtypes}
    return _flat_step_traced(
        tx, step, opt_state, flat_grads, flat_params, extra, apply_updates, master, dtypes
    )


# The eager path: one compiled program per (tx, avals, static extras) instead of many small ops.
_flat_step_compiled = jax.jit(_flat_step_joined, static_argnums=(0, 6, 7, 9))


def flat_step(
    tx: optax.GradientTransformation,
    step: Any,
    opt_state: Any,
    flat_grads: FlatParams,
    flat_params: FlatParams | None,
    *,
    apply_updates: bool = True,
    extra_args: Mapping[str, Any] | None = None,
    master: Mapping[str, Any] | None = None,
    param_dtypes: Mapping[str, Any] | None = None,
) -> FlatStep:
    """One optimizer step over the flat, named state: a pure function.

    ``tx.update`` on ``{name: grad}`` and ``{name: param}``, then (with
    ``apply_updates``) the updates applied. Under a JAX transformation it is
    traced inline; called on concrete values it runs as one compiled program,
    cached per ``tx``, shapes and dtypes. Weakly typed grads and params (from
    ``jnp.full(shape, 0.01)``) are made strongly typed first, so they share the
    program of strongly typed ones. Arrays and numbers among ``extra_args`` are
    inputs of that program; anything else (a ``value_fn``) is part of its cache
    key, so pass the same function object every step.
    :meth:`Optimizer.update` is built on it, and so are layers that keep the
    state in another shape (``treeopt.t5x``).

    Args:
        tx: the optax transformation (static: part of the compile key).
        step: the number of updates applied so far (an int32 scalar).
        opt_state: ``tx``'s state over the flat named params.
        flat_grads: ``{name: gradient}``.
        flat_params: ``{name: param}``, or ``None`` when ``tx`` does not read
            params and ``apply_updates`` is False.
        apply_updates: return the new params (default) or the updates.
        extra_args: keyword arguments for ``tx.update`` (e.g. ``value=loss``),
            over the flat named params as ``tx`` sees them.
        master: ``{name: array}``, wider copies of some of the params (master
            weights): ``tx`` runs on them, with the grads cast to their dtype,
            and the step returns them updated; the output for those names is
            the new master cast to the param's dtype (``apply_updates``), or
            that minus the param given, in the master's dtype.
        param_dtypes: ``{name: dtype}`` of the params that have a master, when
            ``flat_params`` is ``None``.

    Returns:
        A :class:`FlatStep` ``(step + 1, new opt_state, new params or updates)``.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> tx = optax.sgd(0.5)
        >>> params = {"w": jnp.ones(2)}
        >>> out = flat_step(tx, jnp.int32(0), tx.init(params), {"w": jnp.ones(2)}, params)
        >>> int(out.step), out.output["w"]
        (1, Array([0.5, 0.5], dtype=float32))
    """
    extra = dict(extra_args or {})
    master = dict(master) if master else None
    if is_tracer(step):
        return _flat_step_traced(
            tx, step, opt_state, flat_grads, flat_params, extra, apply_updates, master, param_dtypes
        )
    flat_grads, flat_params = _strong_tree(flat_grads), _strong_tree(flat_params)
    dynamic, static = _split_extra(extra)
    dtypes = None if param_dtypes is None else tuple((k, jnp.dtype(d).name) for k, d in param_dtypes.items())
    try:
        hash(static)
    except TypeError:  # an unhashable extra argument: compiled for this call only
        one_off = functools.partial(
            _flat_step_traced, tx, extra_args=extra, apply_updates=apply_updates, param_dtypes=param_dtypes
        )
        return jax.jit(one_off)(step, opt_state, flat_grads, flat_params, master=master)
    return _flat_step_compiled(
        tx, step, opt_state, flat_grads, flat_params, dynamic, static, apply_updates, master, dtypes
    )
