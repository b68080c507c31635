"""The optimizer's state as the wings below take it, and an optimizer rebuilt from the parts they return.

They read the optimizer's public fields, so this module imports no optimizer: the optimizer imports it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar, cast

from treeopt._state.state_dict import StateParts
from treeopt._tree.children import EMA, OPT_STATE, STEP, VIEWS

__all__ = ["STATE_VIEWS", "state_parts", "state_views", "with_state_parts", "with_state_views"]

STATE_VIEWS = (STEP.view, OPT_STATE.view, *VIEWS, EMA.view)
"""The views an optimizer's state is shown in (``opt.step``, ``opt.opt_state``, ``opt.master``, ...), in order."""


class HoldsState(Protocol):
    """What these functions read of an optimizer (``treeopt.Optimizer``, which they never import)."""

    step: Any
    opt_state: Any
    precision_state: Any
    ema_state: Any
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
    return StateParts(**{name: getattr(opt, name) for name in StateParts.leaf_fields()}, precision=opt.precision)


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


def state_views(opt: HoldsState) -> dict[str, Any]:
    """``{view: tree}`` of every view of :data:`STATE_VIEWS` (``{}`` where the optimizer holds none of it).

    Example:
        >>> import jax.numpy as jnp, optax, treeopt
        >>> views = state_views(treeopt.Optimizer(optax.sgd(0.1), ema=0.9).init({"w": jnp.ones(2)}))
        >>> list(views), views["ema"]["w"].dtype
        (['step', 'opt_state', 'master', 'rounding', 'ema'], dtype('float32'))
    """
    parts = state_parts(opt)
    shown = {STEP.view: parts.step, **parts.by_part()}
    return {view: shown.get(view, {}) for view in STATE_VIEWS}


def with_state_views(opt: Held, views: Mapping[str, Any]) -> Held:
    """A new optimizer like ``opt`` holding the state its views show (shaped like :func:`state_views`'), by name.

    Example:
        >>> import jax.numpy as jnp, optax, treeopt
        >>> opt = treeopt.Optimizer(optax.sgd(0.1)).init({"w": jnp.ones(2)})
        >>> int(with_state_views(opt, {**state_views(opt), "step": jnp.int32(3)}).step)
        3
    """
    parts = state_parts(cast(HoldsState, opt))
    return with_state_parts(opt, parts.from_parts(views, step=views[STEP.view]))
