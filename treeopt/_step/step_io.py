"""The step corridor: what one optimizer step takes (:class:`StepInputs`) and gives back (:class:`FlatStep`).

The inputs travel together as one pytree: the arrays (step count, optax
state, grads, params, the state of the params' precision, the array extra
arguments) are its leaves, and what must be static under ``jax.jit`` (the
transformation, the precision, ``apply_updates``, the non-array extra
arguments, whether low-bit state takes its block maxima from a twin
evaluation) is its static data. So the eager step is one ``jax.jit`` of one
argument, whose cache key is exactly the static part.

Example:
    >>> import jax.numpy as jnp, optax
    >>> inputs = StepInputs.of(optax.sgd(0.1), jnp.int32(0), {}, {"w": jnp.ones(2)}, None, extra_args={"value": 1.0})
    >>> inputs.extra_args()
    {'value': 1.0}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["ARRAYS", "FlatStep", "StepInputs", "next_step", "strong"]

ARRAYS = (jax.Array, np.ndarray, np.generic)
_DYNAMIC = (*ARRAYS, int, float, complex)


def strong(x: Any) -> Any:
    """``x`` strongly typed if it is a weakly typed array, else ``x``.

    A weakly typed leaf would come back strongly typed from the first jitted
    step and cost one retrace; the state's and the inputs' avals are made
    stable from the start.

    Example:
        >>> import jax.numpy as jnp
        >>> jnp.asarray(1.0).weak_type, strong(jnp.asarray(1.0)).weak_type
        (True, False)
    """
    return jnp.asarray(x, dtype=x.dtype) if isinstance(x, jax.Array) else x


def next_step(step: Any) -> jax.Array:
    """``step + 1``, saturating at the largest value of its dtype (2**31 - 1 for int32) instead of wrapping.

    As optax's own counts do (``optax.safe_increment``): a step count that
    wrapped to a negative number would break the step rule (a checkpoint step
    is non-negative), and a schedule would restart from its first value.

    Example:
        >>> import jax.numpy as jnp
        >>> int(next_step(jnp.int32(4))), int(next_step(jnp.int32(2**31 - 1)))
        (5, 2147483647)
    """
    count = jnp.asarray(step)
    # As optax.safe_increment, but a weakly typed count stays weak: a jitted step then traces once.
    return jnp.where(count < jnp.iinfo(count.dtype).max, count + 1, count)


class FlatStep(NamedTuple):
    """The result of a step: the new step count, the new optax state, its output and the precision's new state.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> from treeopt.step import flat_step
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
    """The new params (``apply_updates=True``) or the updates."""
    precision_state: Any = None
    """The new state of the params' precision (master copies, compensation, key) when the step was given one, else ``None``."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Everything one step takes: array leaves, and the static data that keys its compiled program."""

    step: Any
    opt_state: Any
    grads: Any
    params: Any
    precision_state: Any
    dynamic_extra: list[Any]
    tx: optax.GradientTransformation = dataclasses.field(metadata={"static": True})
    precision: Any = dataclasses.field(metadata={"static": True})
    apply_updates: bool = dataclasses.field(metadata={"static": True})
    static_extra: Any = dataclasses.field(metadata={"static": True})
    twin: bool = dataclasses.field(default=False, metadata={"static": True})

    @classmethod
    def of(
        cls,
        tx: optax.GradientTransformation,
        step: Any,
        opt_state: Any,
        grads: Any,
        params: Any,
        *,
        precision: Any = None,
        precision_state: Any = None,
        apply_updates: bool = True,
        extra_args: Mapping[str, Any] | None = None,
        twin: bool = False,
    ) -> StepInputs:
        """The inputs of one step; the extra arguments split into arrays (traced) and the rest (static).

        ``precision`` is how the params are held (a
        :class:`treeopt._step.precision.Precision`; ``None``: as they are) and
        ``precision_state`` its state. Arrays and numbers among the extra
        arguments are inputs of the compiled step; anything else (a
        ``value_fn``, strings) is static. ``twin``: low-bit state takes its
        block maxima from a twin evaluation of the step.
        """
        leaves, treedef = jax.tree.flatten(dict(extra_args or {}))
        dynamic = [strong(x) if isinstance(x, _DYNAMIC) else None for x in leaves]
        fixed = tuple(None if isinstance(x, _DYNAMIC) else x for x in leaves)
        return cls(
            step, opt_state, grads, params, precision_state, dynamic,
            tx, precision, apply_updates, (treedef, fixed), twin,
        )  # fmt: skip

    def extra_args(self) -> dict[str, Any]:
        """The extra arguments of ``tx.update``, joined again from their two parts."""
        treedef, fixed = self.static_extra
        return treedef.unflatten([d if f is None else f for d, f in zip(self.dynamic_extra, fixed, strict=True)])

    def hashable(self) -> bool:
        """Whether the static data can key a compiled program (an unhashable extra argument cannot)."""
        try:
            hash((self.tx, self.precision, self.static_extra))
        except TypeError:
            return False
        return True
