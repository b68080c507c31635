"""The optimizer's state as the wings below take it, and an optimizer rebuilt from the parts they return.

They read the optimizer's public fields, so this module imports no optimizer: the optimizer imports it.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol, TypeVar

from treeopt._state.state_dict import StateParts

__all__ = ["state_parts", "with_state_parts"]


class HoldsState(Protocol):
    """What these functions read of an optimizer (``treeopt.Optimizer``, which they never import)."""

    step: Any
    opt_state: Any
    precision_state: Any
    precision: Any

    @property
    def layout(self) -> Any: ...


Held = TypeVar("Held")


def state_parts(opt: HoldsState) -> StateParts:
    """The leaves of an initialized optimizer's state, as the layers below it take them.

    Example:
        >>> import jax.numpy as jnp, optax, treeopt
        >>> parts = state_parts(treeopt.Optimizer(optax.sgd(0.1)).init({"w": jnp.ones(2)}))
        >>> int(parts.step), parts.precision, parts.by_part()["master"]
        (0, AsIs(), {})
    """
    opt.layout  # noqa: B018 - reading it raises the error that says to call init first
    return StateParts(opt.step, opt.opt_state, opt.precision_state, opt.precision)


def with_state_parts(opt: Held, parts: StateParts) -> Held:
    """A new optimizer like ``opt`` (same transformation and layout) holding ``parts``.

    Example:
        >>> import jax.numpy as jnp, optax, treeopt
        >>> opt = treeopt.Optimizer(optax.sgd(0.1)).init({"w": jnp.ones(2)})
        >>> import dataclasses
        >>> int(with_state_parts(opt, dataclasses.replace(state_parts(opt), step=jnp.int32(5))).step)
        5
    """
    rebuilt = copy.copy(opt)  # a new optimizer with opt's fields (its __reduce__)
    for name in parts.leaf_fields():  # by name: the optimizer holds each field of the parts under its name
        object.__setattr__(rebuilt, name, getattr(parts, name))
    return rebuilt
