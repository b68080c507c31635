"""What ``tx.init`` sees, and the state beside the optax state, for fresh params.

With master weights, ``tx.init`` sees the master copies; with ``param_rounding``,
the narrow params cast up to float32; with ``optax.LookaheadParams``, the
fast and slow params by name.

Example:
    >>> import jax.numpy as jnp
    >>> from treeopt.layout import ParamLayout
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> flat, master, rounding = init_inputs(ParamLayout.of(params), params, False, None, "kahan")
    >>> flat["w"].dtype, master, rounding["compensation"]["w"].dtype
    (dtype('float32'), {}, dtype(bfloat16))
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax

from treeopt._step.master import masters_of
from treeopt._step.rounding import initial_rounding, narrow
from treeopt._tree.layout import ParamLayout

__all__ = ["as_transformation", "init_inputs", "transformation_name"]


def init_inputs(
    layout: ParamLayout, params: Any, lookahead: bool, master_dtype: Any, param_rounding: str | None
) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """``(what tx.init sees, master copies, rounding state)`` of fresh ``params``."""
    if lookahead:
        for option, value in (("master_dtype", master_dtype), ("param_rounding", param_rounding)):
            if value is not None:
                raise ValueError(
                    f"{option} is not supported with optax.LookaheadParams (optax.lookahead): "
                    "build the optimizer without it."
                )
        flat = optax.LookaheadParams(layout.split_params(params.fast)[0], layout.split_params(params.slow)[0])
        return flat, {}, {}
    flat = layout.split_params(params)[0]
    master = masters_of(flat, master_dtype)
    rounding = initial_rounding(flat, param_rounding)
    if param_rounding is not None:
        flat = {k: v.astype(jnp.float32) if narrow(v.dtype) else v for k, v in flat.items()}
    return {**flat, **master}, master, rounding  # tx.init sees the masters


def as_transformation(tx: Any) -> optax.GradientTransformation:
    """``tx`` as the optimizer keeps it (an ``optax.MultiSteps`` as its transformation), or an error saying why not.

    Example:
        >>> import optax
        >>> as_transformation(optax.adam)
        Traceback (most recent call last):
        ...
        TypeError: Optimizer(tx) needs an optax.GradientTransformation such as optax.adam(1e-3), got function. It is callable: did you pass the factory instead of calling it, e.g. optax.adam(1e-3)?
    """
    if isinstance(tx, optax.MultiSteps):
        return tx.gradient_transformation()
    if isinstance(tx, optax.GradientTransformation):
        return tx
    hint = ""
    if callable(tx):
        hint = " It is callable: did you pass the factory instead of calling it, e.g. optax.adam(1e-3)?"
    raise TypeError(
        "Optimizer(tx) needs an optax.GradientTransformation such as optax.adam(1e-3), "
        f"got {type(tx).__name__}.{hint}"
    )


def transformation_name(tx: optax.GradientTransformation) -> str:
    """A short name of ``tx`` for reprs: the function that built it.

    Example:
        >>> import optax
        >>> transformation_name(optax.adam(1e-3)), transformation_name(optax.scale_by_adam())
        ('chain', 'scale_by_adam')
    """
    init = getattr(tx, "init", None)
    qualname = getattr(init, "__qualname__", "")
    return qualname.split(".<locals>")[0] or type(tx).__name__
