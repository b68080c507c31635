"""The traced step: :func:`flat_step`, the pure function ``Optimizer.update`` runs (its face is ``treeopt.step``).

:func:`flat_step` applies ``tx.update`` to ``{name: grad}`` and ``{name:
param}`` through the params' precision, reads low-bit state as floats and
encodes it again, and returns a :class:`FlatStep`. Traced inline under a JAX
transformation; called eagerly, it runs one compiled program per
transformation and shapes, so an eager step costs one dispatch.
``Optimizer.init`` also fixes the state's dtypes here (:func:`stable_dtypes`),
so that the jitted step traces once.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from treeopt._lowbit import decoded, encoded_after_step, has_quantized
from treeopt._sharding.explicit import in_state_layout
from treeopt._sharding.ownership import owning
from treeopt._step.precision import Precision, narrower, precision_step
from treeopt._step.step_io import FlatStep, StepInputs, strong
from treeopt.typing import Params

__all__ = ["FlatStep", "flat_step"]


def stable_dtypes(tx: optax.GradientTransformation, opt_state: Any, flat: Any, lookahead: bool) -> Any:
    """``opt_state`` with the dtypes that ``tx.update`` gives it back.

    Some transformations return a state leaf in another dtype than ``init``
    made it (``inject_hyperparams(adamw)`` turns the ``mu`` of a bfloat16
    param into float32 through its float32 hyperparameters). Fixing the dtypes
    at init means one trace of the jitted step, and a state dict that always
    loads into ``init`` / ``eval_shape(init)``. Found by tracing updates
    (shapes only, nothing runs) until the dtypes stop changing.
    """
    if not any(narrower(getattr(leaf, "dtype", None)) for leaf in jax.tree.leaves(opt_state)):
        return opt_state  # 32/64-bit state: nothing to promote, and tracing costs ~1 ms a leaf
    grads = flat.fast if lookahead else flat
    state = opt_state
    for _ in range(3):
        try:
            inputs = StepInputs.of(tx, jnp.zeros((), jnp.int32), state, grads, flat, apply_updates=False)
            after = jax.eval_shape(_traced, inputs).opt_state
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


def _traced(inputs: StepInputs, extra_args: Mapping[str, Any] | None = None) -> FlatStep:
    """The step itself; :func:`flat_step` decides whether it runs traced or compiled.

    Low-bit state leaves are read as floats for ``tx.update`` and encoded again
    after it; on a CPU, against block maxima taken from a twin of the step
    (:func:`treeopt._lowbit.state.encoded_after_step` says why). On an
    accelerator XLA fuses a reduction with the values it reduces, and one
    evaluation serves.
    """
    extra = inputs.extra_args() if extra_args is None else extra_args
    grads, params = in_state_layout(inputs.grads, inputs.params, inputs.opt_state, inputs.precision_state)
    inputs = dataclasses.replace(inputs, grads=grads, params=params)
    held = inputs.opt_state
    if not has_quantized(held):
        return precision_step(inputs, extra)
    if not inputs.twin:
        out = precision_step(dataclasses.replace(inputs, opt_state=decoded(held)), extra)
        return out._replace(opt_state=encoded_after_step(held, out.opt_state))
    twin_inputs = jax.lax.optimization_barrier(inputs)
    out = precision_step(dataclasses.replace(twin_inputs, opt_state=decoded(twin_inputs.opt_state)), extra)
    main = precision_step(dataclasses.replace(inputs, opt_state=decoded(held)), extra)
    outputs = out.output if isinstance(out.output, Mapping) else None
    return out._replace(opt_state=encoded_after_step(held, main.opt_state, out.opt_state, outputs))


TWIN_EVALUATION: bool | None = None
"""Whether a step with low-bit state evaluates a twin for the block maxima: ``None`` decides by the backend.

Read when a step's inputs are gathered, into their static data: a step after
it changed is compiled again, never served the other program.
"""


def twin_evaluation() -> bool:
    """Whether a low-bit step takes its block maxima from a twin evaluation: on a CPU, unless told otherwise.

    Example:
        >>> import jax
        >>> twin_evaluation() == (jax.default_backend() == "cpu")
        True
    """
    return jax.default_backend() == "cpu" if TWIN_EVALUATION is None else TWIN_EVALUATION


# The eager path: one compiled program per (tx, avals, static extras) instead of many small ops.
_compiled = jax.jit(_traced)


def flat_step(
    tx: optax.GradientTransformation,
    step: Any,
    opt_state: Any,
    flat_grads: Params,
    flat_params: Params | None,
    *,
    apply_updates: bool = True,
    extra_args: Mapping[str, Any] | None = None,
    precision: Precision | None = None,
    precision_state: Any = None,
    owned: Any = None,
) -> FlatStep:
    """One optimizer step over the flat, named state: a pure function.

    ``tx.update`` on the grads and params, then (with ``apply_updates``) the
    updates applied. ``Optimizer.update`` hands it ``{name: grad}`` and
    ``{name: param}``; it works on any grads and params trees that ``tx``'s
    state was made for (``treeopt.t5x`` hands it the nested target). Under a
    JAX transformation it is traced inline; called on concrete values it runs
    as one compiled program, cached per ``tx``, shapes and dtypes. Weakly typed
    grads and params (from ``jnp.full(shape, 0.01)``) are made strongly typed
    first, so they share the program of strongly typed ones. Arrays and
    numbers among ``extra_args`` are inputs of that program; anything else (a
    ``value_fn``) is part of its cache key, so pass the same function object
    every step.

    Args:
        tx: the optax transformation (static: part of the compile key).
        step: the number of updates applied so far (an int32 scalar).
        opt_state: ``tx``'s state over the params.
        flat_grads: the gradients, ``{name: gradient}`` for the core.
        flat_params: the params, or ``None`` when ``tx`` does not read
            params and ``apply_updates`` is False.
        apply_updates: return the new params (default) or the updates.
        extra_args: keyword arguments for ``tx.update`` (e.g. ``value=loss``),
            over the params as ``tx`` sees them.
        precision: how the params are held (static: part of the compile
            key), as an optimizer holds it (``opt.precision``): master
            weights (``tx`` runs on wider copies, with the grads cast to
            their dtype; the output for those names is the new copy cast to
            the param's dtype, or that minus the param given, in the copy's
            dtype), Kahan or stochastic rounding (``tx`` runs on the narrow
            params cast to float32, the new values are rounded back into
            their dtype). ``None``: every param as it is.
        precision_state: the state of ``precision`` (``opt.precision_state``):
            the master copies, the compensation buffers or the key.
        owned: on a mesh, whose whole-leaf matrices one owner device computes
            (``opt.owned``; ``None``: all): ``tx`` runs wrapped by ``owning``.

    Returns:
        A :class:`FlatStep` ``(step + 1, new opt_state, new params or updates,
        the precision's new state)``.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> tx = optax.sgd(0.5)
        >>> params = {"w": jnp.ones(2)}
        >>> out = flat_step(tx, jnp.int32(0), tx.init(params), {"w": jnp.ones(2)}, params)
        >>> int(out.step), out.output["w"]
        (1, Array([0.5, 0.5], dtype=float32))
    """
    twin = twin_evaluation()
    tx = owning(tx, owned)

    def inputs(extra: Mapping[str, Any] | None = None) -> StepInputs:
        return StepInputs.of(
            tx, step, opt_state, flat_grads, flat_params, precision=precision,
            precision_state=precision_state, apply_updates=apply_updates, extra_args=extra, twin=twin,
        )  # fmt: skip

    if isinstance(step, jax.core.Tracer):
        return _traced(inputs(), dict(extra_args or {}))
    # The step count too: the saturating increment returns it strongly typed, and one program serves both.
    step, flat_grads, flat_params = strong(jnp.asarray(step)), _strong_tree(flat_grads), _strong_tree(flat_params)
    with_extra = inputs(extra_args)
    if with_extra.hashable():
        return _compiled(with_extra)
    # An unhashable extra argument: compiled for this call only, with the extras closed over.
    return jax.jit(functools.partial(_traced, extra_args=dict(extra_args or {})))(inputs())
