"""Master weights: wider copies of the narrower trainable params, which the optimizer steps instead.

``Optimizer(tx, master_dtype=jnp.float32)`` keeps, for every trainable
floating leaf narrower than ``master_dtype`` (bfloat16, float16, float8), a
copy in ``master_dtype`` keyed by its name; ``tx`` runs on those copies
(:func:`master_step`, which :func:`treeopt.step.flat_step` runs when given
masters) and the params get them cast back to their own dtype. Leaves already
as wide are stepped as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from treeopt._state.step_io import FlatStep, StepInputs


def checked_master_dtype(master_dtype: Any) -> np.dtype | None:
    """``master_dtype`` as a floating NumPy dtype (``None`` stays ``None``), or an error saying why not.

    Example:
        >>> import jax.numpy as jnp
        >>> checked_master_dtype(jnp.float32), checked_master_dtype("float32"), checked_master_dtype(None)
        (dtype('float32'), dtype('float32'), None)
        >>> checked_master_dtype(jnp.int32)
        Traceback (most recent call last):
        ...
        TypeError: master_dtype must be a floating-point dtype such as jnp.float32, got int32.
    """
    if master_dtype is None:
        return None
    try:
        dtype = jnp.dtype(master_dtype)
    except TypeError:
        raise TypeError(
            f"master_dtype must be a floating-point dtype such as jnp.float32, got {master_dtype!r}."
        ) from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"master_dtype must be a floating-point dtype such as jnp.float32, got {dtype.name}.")
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:
        raise ValueError(
            f"master_dtype={dtype.name} needs 64-bit JAX: set jax.config.update('jax_enable_x64', True) "
            "first, or use jnp.float32."
        )
    return dtype


def narrower(dtype: Any, master_dtype: np.dtype) -> bool:
    """Whether a leaf of ``dtype`` gets a master copy: a real floating dtype with fewer bits.

    Example:
        >>> import jax.numpy as jnp
        >>> narrower(jnp.bfloat16, jnp.dtype("float32")), narrower(jnp.float32, jnp.dtype("float32"))
        (True, False)
    """
    return bool(jnp.issubdtype(dtype, jnp.floating)) and jnp.finfo(dtype).bits < jnp.finfo(master_dtype).bits


def masters_of(flat: Mapping[str, Any], master_dtype: np.dtype | None) -> dict[str, Any]:
    """``{name: leaf cast to master_dtype}`` for the leaves of ``flat`` narrower than it.

    Example:
        >>> import jax.numpy as jnp
        >>> masters = masters_of({"w": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2)}, jnp.dtype("float32"))
        >>> {name: m.dtype.name for name, m in masters.items()}
        {'w': 'float32'}
    """
    if master_dtype is None:
        return {}
    return {
        name: leaf.astype(master_dtype) for name, leaf in flat.items() if narrower(leaf.dtype, master_dtype)
    }


def param_dtypes_of(layout: Any, master: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: dtype}`` of the params that have a master, as ``init`` saw them (from the layout).

    Example:
        >>> import jax.numpy as jnp
        >>> from treeopt.layout import ParamLayout
        >>> layout = ParamLayout.of({"w": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2)})
        >>> param_dtypes_of(layout, {"w": jnp.ones(2)})
        {'w': dtype(bfloat16)}
    """
    return {
        name: dtype for name, (_, dtype) in zip(layout.names, layout.avals, strict=True) if name in master
    }


def master_step(inputs: StepInputs, extra: Mapping[str, Any]) -> FlatStep:
    """The step on the master copies: grads cast up, ``tx`` run and applied on the masters.

    Leaves without a master are stepped as without them. The output for a
    leaf with one is its new master cast to the param's dtype, or (the
    updates) that minus the param given, in the master's dtype.
    """
    master, flat_grads, flat_params = inputs.master, inputs.grads, inputs.params
    grads = {k: g.astype(master[k].dtype) if k in master else g for k, g in flat_grads.items()}
    params: dict[str, Any] | None
    if flat_params is not None:
        params = {k: master[k] if k in master else p for k, p in flat_params.items()}
        dtypes = {k: flat_params[k].dtype for k in master}
    else:  # tx reads the masters, if every trained leaf has one
        params = {k: master[k] for k in flat_grads} if set(flat_grads) <= set(master) else None
        dtypes = inputs.dtypes() or {}
    updates, new_state = inputs.tx.update(grads, inputs.opt_state, params, **extra)
    new_master = optax.apply_updates(dict(master), {k: updates[k] for k in master})
    out = {}
    for k in flat_grads:
        if k not in master:
            out[k] = optax.apply_updates(flat_params[k], updates[k]) if inputs.apply_updates else updates[k]
        elif inputs.apply_updates:
            out[k] = new_master[k].astype(dtypes[k])
        else:
            given = flat_params[k] if flat_params is not None else master[k].astype(dtypes[k])
            out[k] = new_master[k].astype(dtypes[k]).astype(master[k].dtype) - given.astype(master[k].dtype)
    return FlatStep(jnp.asarray(inputs.step) + 1, new_state, out, new_master)
