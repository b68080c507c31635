"""The transformation as the optimizer keeps it, and what ``tx.init`` sees for fresh params.

The params' precision (:mod:`treeopt._step.precision`) decides what ``tx.init``
sees (the master copies, or the narrow params cast up to float32) and makes
its own state beside the optax state; with ``optax.LookaheadParams``,
``tx.init`` sees the fast and slow params by name.

Example:
    >>> import jax.numpy as jnp
    >>> from treeopt._step.precision import Kahan
    >>> from treeopt.layout import ParamLayout
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> flat, state = init_inputs(ParamLayout.of(params), params, False, Kahan())
    >>> flat["w"].dtype, state.compensation["w"].dtype
    (dtype('float32'), dtype(bfloat16))
"""

from __future__ import annotations

from typing import Any

import optax

from treeopt._step.precision import AsIsState, Precision
from treeopt._tree.layout import ParamLayout

__all__ = ["as_transformation", "init_inputs", "transformation_name"]


def init_inputs(layout: ParamLayout, params: Any, lookahead: bool, precision: Precision) -> tuple[Any, Any]:
    """``(what tx.init sees, the precision's state)`` of fresh ``params``."""
    if lookahead:
        if precision.option is not None:
            raise ValueError(
                f"{precision.option} is not supported with optax.LookaheadParams (optax.lookahead): "
                "build the optimizer without it."
            )
        flat = optax.LookaheadParams(layout.split_params(params.fast)[0], layout.split_params(params.slow)[0])
        return flat, AsIsState()
    return precision.init(layout.split_params(params)[0])


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
