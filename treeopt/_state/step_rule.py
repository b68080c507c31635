"""The one rule for step numbers: a non-negative integer.

A checkpoint step (``CheckpointManager.save(step, ...)``) and the ``"step"``
of a state dict (``opt.load_state_dict(sd)``) follow it alike, so a step a
state dict loads can always be saved as a checkpoint step, and the reverse.

Example:
    >>> import numpy as np
    >>> check_step(np.int32(3))
    3
    >>> try:
    ...     check_step(-1)
    ... except ValueError as e:
    ...     print(e)
    A checkpoint step must be a non-negative integer, got -1.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from treeopt.errors import StateDictError

EXPECTED = "a non-negative integer"


def integer(value: Any) -> int | None:
    """``value`` as an int if it is a known integer (not a bool): int, numpy integer, 0-d integer array.

    ``None`` for anything else, traced and abstract arrays included (their value is not known).

    Example:
        >>> import jax.numpy as jnp
        >>> integer(jnp.int32(4)), integer(4.0), integer(True), integer(jax.ShapeDtypeStruct((), jnp.int32))
        (4, None, None, None)
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if not isinstance(value, (np.ndarray, np.generic, jax.Array)) or isinstance(value, jax.core.Tracer):
        return None
    if value.shape == () and np.issubdtype(value.dtype, np.integer):
        return int(value)
    return None


def check_step(step: Any, what: str = "A checkpoint step") -> int:
    """``step`` as a non-negative int, or a ``TypeError`` / ``ValueError`` saying what is expected."""
    value = integer(step)
    if value is None:
        raise TypeError(
            f"{what} must be {EXPECTED} (an int, a numpy integer or a 0-d integer array such as "
            f"opt.step), got {step!r} of type {type(step).__name__}."
        )
    if value < 0:
        raise ValueError(f"{what} must be {EXPECTED}, got {value}.")
    return value


def negative(step: Any) -> int | None:
    """The value of ``step`` if it is a known negative integer (a state dict's step that breaks the rule)."""
    value = integer(step)
    return value if value is not None and value < 0 else None


def refuse_a_negative_step(state_dict: Any, lead: str, path: str = "step") -> None:
    """A ``StateDictError`` if the ``"step"`` of ``state_dict`` is a negative integer, strict or not.

    A state dict's step follows the rule of checkpoint steps. The error opens
    with ``lead`` (what does not match what) and names the step at ``path``.

    Example:
        >>> refuse_a_negative_step({"step": 3}, "The state dict does not match")
        >>> try:
        ...     refuse_a_negative_step({"step": -1}, "The state dict does not match")
        ... except StateDictError as e:
        ...     print(str(e).splitlines()[-1])
          step: expected a non-negative integer (the rule of checkpoint steps too), got -1
    """
    value = negative(state_dict.get("step")) if isinstance(state_dict, Mapping) else None
    if value is not None:
        raise StateDictError.between(
            lead, mismatched=[(path, f"{EXPECTED} (the rule of checkpoint steps too)", str(value))]
        )
