"""The optimizer's precision options checked, and the :class:`~treeopt._step.precision.Precision` they choose.

``master_dtype``, ``param_rounding`` and ``rounding_seed`` are read once,
at construction: :func:`precision_of` turns them into the optimizer's one
precision, static data from then on.

Example:
    >>> import jax.numpy as jnp
    >>> precision_of(checked_master_dtype(jnp.float32), None), precision_of(None, "stochastic", 3)
    (MasterWeights(dtype=dtype('float32')), Stochastic(seed=3))
"""

from __future__ import annotations

import functools
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from treeopt._step.precision import AS_IS, ROUNDINGS, MasterWeights, Precision, Stochastic

__all__ = ["DEFAULT_SEED", "checked_master_dtype", "checked_param_rounding", "checked_rounding_seed", "precision_of"]

DEFAULT_SEED = 0
"""The seed of stochastic rounding's key when ``rounding_seed`` is not given: ``jax.random.key(0)``."""


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


def _choices() -> str:
    names = [repr(name) for name in ROUNDINGS]
    return ", ".join(["None", *names[:-1]]) + f" or {names[-1]}"


def checked_param_rounding(param_rounding: Any, master_dtype: Any) -> str | None:
    """``param_rounding`` checked: ``None`` or a name of :data:`ROUNDINGS`, and never beside ``master_dtype``.

    Example:
        >>> checked_param_rounding("kahan", None)
        'kahan'
        >>> checked_param_rounding("nearest", None)
        Traceback (most recent call last):
        ...
        ValueError: param_rounding must be None, 'kahan' or 'stochastic', got 'nearest'.
    """
    if not (param_rounding is None or (isinstance(param_rounding, str) and param_rounding in ROUNDINGS)):
        raise ValueError(f"param_rounding must be {_choices()}, got {param_rounding!r}.")
    if param_rounding is not None and master_dtype is not None:
        raise ValueError(
            f"param_rounding={param_rounding!r} and master_dtype={np.dtype(master_dtype).name} are two ways "
            "to train narrow params: master_dtype keeps a wider copy of each, param_rounding keeps none. "
            "Pass one of them."
        )
    return param_rounding


def checked_rounding_seed(rounding_seed: Any, param_rounding: str | None) -> int:
    """``rounding_seed`` as the seed of stochastic rounding's key (``None``: :data:`DEFAULT_SEED`), or an error.

    A seed is an integer that ``jax.random.key`` takes, and it is refused
    where nothing draws from it (``param_rounding`` other than ``"stochastic"``).

    Example:
        >>> checked_rounding_seed(None, "stochastic"), checked_rounding_seed(42, "stochastic")
        (0, 42)
        >>> checked_rounding_seed(1, "kahan")
        Traceback (most recent call last):
        ...
        ValueError: rounding_seed=1 seeds the key of param_rounding='stochastic', and param_rounding is 'kahan': nothing would draw from it. Pass param_rounding='stochastic', or no rounding_seed.
    """
    if rounding_seed is None:
        return DEFAULT_SEED
    if isinstance(rounding_seed, bool) or not isinstance(rounding_seed, numbers.Integral):
        raise TypeError(
            f"rounding_seed must be an integer (the seed of jax.random.key), got {rounding_seed!r} of type "
            f"{type(rounding_seed).__name__}."
        )
    if not 0 <= int(rounding_seed) < 2**32:
        raise ValueError(f"rounding_seed must be an integer in [0, 2**32), got {int(rounding_seed)}.")
    if param_rounding != Stochastic.choice:
        raise ValueError(
            f"rounding_seed={int(rounding_seed)} seeds the key of param_rounding='stochastic', and "
            f"param_rounding is {param_rounding!r}: nothing would draw from it. Pass "
            "param_rounding='stochastic', or no rounding_seed."
        )
    return int(rounding_seed)


@functools.cache
def precision_of(
    master_dtype: np.dtype | None, param_rounding: str | None, rounding_seed: int = DEFAULT_SEED
) -> Precision:
    """The precision that the optimizer's checked options choose.

    Example:
        >>> precision_of(None, "kahan"), precision_of(None, None), precision_of(None, "stochastic", 3)
        (Kahan(), AsIs(), Stochastic(seed=3))
    """
    if master_dtype is not None:
        return MasterWeights(master_dtype)
    if param_rounding is None:
        return AS_IS
    if param_rounding == Stochastic.choice:
        return Stochastic(seed=rounding_seed)
    return ROUNDINGS[param_rounding]()
