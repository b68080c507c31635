"""Abstract optimizers and params (``jax.eval_shape``), with an error that says how to build them.

``jax.eval_shape`` takes and returns arrays only. An equinox module also holds
functions (its activations), so ``jax.eval_shape`` of a function that returns
one fails with JAX's "... is not a valid JAX type", and of one that takes one
with "Error interpreting argument ... as an abstract array". Where
treeopt evaluates shapes itself, :func:`eval_shape` adds a note to that error
naming the fix: ``equinox.filter_eval_shape`` for an abstract target, and the
module's arrays (``equinox.filter(model, equinox.is_array)``) for treeopt.

Example:
    >>> import jax, jax.numpy as jnp
    >>> eval_shape(lambda x: 2 * x, jnp.ones(3))
    ShapeDtypeStruct(shape=(3,), dtype=float32)
    >>> try:
    ...     eval_shape(lambda: {"w": jnp.ones(3), "act": jax.nn.relu})
    ... except TypeError as error:
    ...     print(error.__notes__[-1].splitlines()[0])
    jax.eval_shape takes and returns arrays only; equinox modules hold functions too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

__all__ = ["NON_ARRAY_HINT", "eval_shape"]

NON_ARRAY_HINT = (
    "jax.eval_shape takes and returns arrays only; equinox modules hold functions too.\n"
    "For an abstract target, evaluate with equinox.filter_eval_shape instead: it makes\n"
    "the arrays abstract and keeps the rest, e.g.\n"
    "    abstract_model, abstract_opt = eqx.filter_eval_shape(fresh_start)\n"
    "    opt, model = treeopt.checkpoint.restore(path, abstract_opt, params=abstract_model)\n"
    "Where treeopt takes params, eqx.filter(model, eqx.is_array) gives the module's arrays."
)


# JAX's words for a leaf that is not an array: in a function's result, and in its arguments.
_INVALID_LEAF = ("is not a valid JAX type", "as an abstract array")


def is_invalid_leaf_error(error: BaseException) -> bool:
    """Whether ``error`` is JAX's refusal of a leaf that is not an array (a function, a string).

    Example:
        >>> is_invalid_leaf_error(TypeError("... of type <class 'function'> is not a valid JAX type"))
        True
        >>> is_invalid_leaf_error(TypeError("Error interpreting argument to f as an abstract array."))
        True
        >>> is_invalid_leaf_error(TypeError("unsupported operand"))
        False
    """
    return isinstance(error, TypeError) and any(words in str(error) for words in _INVALID_LEAF)


def eval_shape(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``jax.eval_shape(fn, *args, **kwargs)``; a leaf that is not an array gets :data:`NON_ARRAY_HINT`.

    Example:
        >>> import jax.numpy as jnp
        >>> eval_shape(jnp.zeros_like, jnp.ones((2, 3))).shape
        (2, 3)
    """
    try:
        return jax.eval_shape(fn, *args, **kwargs)
    except TypeError as error:
        if is_invalid_leaf_error(error):
            error.add_note(NON_ARRAY_HINT)
        raise
