"""The step corridor: what one optimizer step takes (:class:`StepInputs`) and gives back (:class:`FlatStep`).

The inputs travel together as one pytree: the arrays (step count, optax
state, grads, params, masters, the array extra arguments) are its leaves, and
what must be static under ``jax.jit`` (the transformation, ``apply_updates``,
the non-array extra arguments, the params' dtypes) is its static data. So the
eager step is one ``jax.jit`` of one argument, whose cache key is exactly the
static part.

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

__all__ = ["ARRAYS", "FlatStep", "StepInputs"]

ARRAYS = (jax.Array, np.ndarray, np.generic)
_DYNAMIC = (*ARRAYS, int, float, complex)


def _strong(x: Any) -> Any:
    # A weakly typed leaf would come back strongly typed from the first jitted
    # step and cost one retrace; make the avals stable from the start.
    return jnp.asarray(x, dtype=x.dtype) if isinstance(x, jax.Array) else x


class FlatStep(NamedTuple):
    """The result of a step: the new step count, the new optax state, its output and masters.

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
    master: Any = None
    """The new master copies ``{name: array}`` when the step was given masters, else ``None``."""
    rounding: Any = None
    """The new rounding state (compensation or key) when the step rounds narrow params, else ``None``."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """Everything one step takes: array leaves, and the static data that keys its compiled program."""

    step: Any
    opt_state: Any
    grads: Any
    params: Any
    master: Any
    rounding: Any
    dynamic_extra: list[Any]
    tx: optax.GradientTransformation = dataclasses.field(metadata={"static": True})
    apply_updates: bool = dataclasses.field(metadata={"static": True})
    static_extra: Any = dataclasses.field(metadata={"static": True})
    param_dtypes: tuple[tuple[str, str], ...] | None = dataclasses.field(metadata={"static": True})

    @classmethod
    def of(
        cls,
        tx: optax.GradientTransformation,
        step: Any,
        opt_state: Any,
        grads: Any,
        params: Any,
        *,
        apply_updates: bool = True,
        extra_args: Mapping[str, Any] | None = None,
        master: Mapping[str, Any] | None = None,
        rounding: Mapping[str, Any] | None = None,
        param_dtypes: Mapping[str, Any] | None = None,
    ) -> StepInputs:
        """The inputs of one step; the extra arguments split into arrays (traced) and the rest (static).

        Arrays and numbers among the extra arguments are inputs of the
        compiled step; anything else (a ``value_fn``, strings) is static.
        """
        leaves, treedef = jax.tree.flatten(dict(extra_args or {}))
        dynamic = [_strong(x) if isinstance(x, _DYNAMIC) else None for x in leaves]
        fixed = tuple(None if isinstance(x, _DYNAMIC) else x for x in leaves)
        dtypes = None if param_dtypes is None else tuple((k, jnp.dtype(d).name) for k, d in param_dtypes.items())
        return cls(
            step, opt_state, grads, params, dict(master) if master else None,
            dict(rounding) if rounding else None, dynamic,
            tx, apply_updates, (treedef, fixed), dtypes,
        )  # fmt: skip

    def extra_args(self) -> dict[str, Any]:
        """The extra arguments of ``tx.update``, joined again from their two parts."""
        treedef, fixed = self.static_extra
        return treedef.unflatten([d if f is None else f for d, f in zip(self.dynamic_extra, fixed, strict=True)])

    def dtypes(self) -> dict[str, Any] | None:
        """``{name: dtype}`` of the params that have a master, when the params are not given."""
        return None if self.param_dtypes is None else {k: jnp.dtype(d) for k, d in self.param_dtypes}

    def hashable(self) -> bool:
        """Whether the static data can key a compiled program (an unhashable extra argument cannot)."""
        try:
            hash((self.tx, self.static_extra, self.param_dtypes))
        except TypeError:
            return False
        return True
