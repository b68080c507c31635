"""Master weights: wider copies of the narrower trainable params, which the optimizer steps instead.

``Optimizer(tx, master_dtype=jnp.float32)`` keeps, for every trainable
floating leaf narrower than ``master_dtype`` (bfloat16, float16, float8), a
copy in ``master_dtype`` keyed by its name; ``tx`` runs on those copies
(:func:`master_step`, which :func:`treeopt.step.flat_step` runs when given
masters) and the params get them cast back to their own dtype. Leaves already
as wide are stepped as they are.

A param that no longer equals its master cast down (weights loaded or
written after ``init``, a state dict loaded without masters) wins: the step
first takes its master from it again (:func:`follow_params`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from treeopt._sharding.explicit import resharded_like
from treeopt._step.step_io import FlatStep, StepInputs
from treeopt._step.step_rule import next_step


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


def follow_params(master: Mapping[str, Any], flat_params: Mapping[str, Any]) -> dict[str, Any]:
    """Each master, or its param cast up where the param no longer equals the master cast down.

    One fused compare-and-select per leaf, traced inside the step: a param that
    the step itself returned equals its master cast down, so its master (with
    the bits the param lacks) is kept; a param changed behind the optimizer wins.

    Example:
        >>> import jax.numpy as jnp
        >>> master = {"w": jnp.asarray([1.0001, 2.0001], jnp.float32)}
        >>> params = {"w": jnp.asarray([1.0, 5.0], jnp.bfloat16)}
        >>> follow_params(master, params)["w"].tolist()
        [1.000100016593933, 5.0]
    """
    out = dict(master)
    for name, m in master.items():
        p = flat_params.get(name)
        if p is not None:
            wide = resharded_like(p.astype(m.dtype), m)  # exact: the param's value, on the master's shards
            out[name] = jnp.where(wide == m.astype(p.dtype).astype(m.dtype), m, wide)
    return out


def check_some_narrower(flat: Mapping[str, Any], master_dtype: np.dtype | None) -> None:
    """A ``ValueError`` if ``master_dtype`` is set but no floating trainable param is narrower than it.

    Such a ``master_dtype`` would silently do nothing (``jnp.bfloat16`` for a bfloat16 model).

    Example:
        >>> import jax.numpy as jnp
        >>> check_some_narrower({"w": jnp.ones(2, jnp.bfloat16)}, jnp.dtype("float32"))
        >>> try:
        ...     check_some_narrower({"w": jnp.ones(2, jnp.bfloat16)}, jnp.dtype("bfloat16"))
        ... except ValueError as e:
        ...     print(str(e).split(":")[0])
        master_dtype=bfloat16 is not wider than any trainable floating param
    """
    if master_dtype is None:
        return
    floating = sorted({str(leaf.dtype) for leaf in flat.values() if jnp.issubdtype(leaf.dtype, jnp.floating)})
    if floating and not any(narrower(leaf.dtype, master_dtype) for leaf in flat.values()):
        raise ValueError(
            f"master_dtype={master_dtype.name} is not wider than any trainable floating param: their "
            f"dtypes are {', '.join(floating)}, so no param would get a master copy. Pass a wider "
            "master_dtype (jnp.float32 for bfloat16 or float16 params), or none."
        )


def masters_of(flat: Mapping[str, Any], master_dtype: np.dtype | None) -> dict[str, Any]:
    """``{name: leaf cast to master_dtype}`` for the leaves of ``flat`` narrower than it.

    A ``ValueError`` (:func:`check_some_narrower`) if no floating leaf is narrower.

    Example:
        >>> import jax.numpy as jnp
        >>> masters = masters_of({"w": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2)}, jnp.dtype("float32"))
        >>> {name: m.dtype.name for name, m in masters.items()}
        {'w': 'float32'}
    """
    if master_dtype is None:
        return {}
    check_some_narrower(flat, master_dtype)
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
    if flat_params is not None:
        master = follow_params(master, flat_params)  # a param changed behind the optimizer wins
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
    return FlatStep(next_step(inputs.step), new_state, out, new_master)
