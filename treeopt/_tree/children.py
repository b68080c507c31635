"""The children of an optimizer's state, each declared once: every layer reads its declaration.

A child is one piece of the state: the step count, the optax state, the
params' precision's own state (master copies, Kahan compensation buffers, a
stochastic-rounding key) and the exponential moving average of the params. Its :class:`StateChild` says, in one place:

- its name in the state dict, and the attribute of its state type holding it;
- the optimizer's read-only view that shows it (``opt.master``, ``opt.rounding``),
  which is also the part ``treeopt.partitioning.zero_report`` names;
- its spec and ZeRO-1 rule: whether its arrays belong to parameters (a leaf
  keyed by a parameter's name takes that parameter's spec; the others are
  replicated) and whether ZeRO-1 splits them over the data axes;
- its precision and quantization policy: the dtype it is held in, and whether
  ``state_bits=`` may hold its statistics as low-bit codes;
- how it is initialized, loaded and warm-started: whether a warm start fills
  it from another run's state (an exact load always matches it by path).

The state dict (:mod:`treeopt._state.state_dict`), the precision layer
(:mod:`treeopt._step.precision`), the sharding wing's ZeRO-1 plan and the
optimizer's views read these declarations; they never list the children
again. A new child is one more declaration here, and its state where it is
made (the EMA's: :mod:`treeopt._step.ema`).

Example:
    >>> MASTER.name, MASTER.view, MASTER.zero, ROUNDING_KEY.zero
    ('master', 'master', True, False)
    >>> [child.name for child in CHILDREN]
    ['step', 'opt_state', 'master', 'compensation', 'rounding_key', 'ema']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, TypeGuard

__all__ = [
    "CHILDREN",
    "COMPENSATION",
    "EMA",
    "MASTER",
    "NO_AVERAGE",
    "OPT_STATE",
    "PRECISION_CHILDREN",
    "ROUNDING_KEY",
    "STEP",
    "VIEWS",
    "StateChild",
    "averaging",
    "child_named",
    "views_of",
]


@dataclasses.dataclass(frozen=True)
class StateChild:
    """One child of the optimizer's state, as every layer reads it.

    Example:
        >>> COMPENSATION.attribute, COMPENSATION.view, COMPENSATION.shown_under
        ('compensation', 'rounding', 'compensation')
    """

    name: str
    """Its entry in the state dict (``sd["master"]``)."""
    attribute: str
    """The field of its state type that holds it (``MasterWeightsState.master``)."""
    view: str
    """The optimizer's read-only view that shows it (``opt.master``), and ``zero_report``'s name of its part."""
    shown_under: str | None
    """The key its view shows it under (``opt.rounding["key"]``); ``None``: the view is the child itself."""
    per_parameter: bool
    """Whether its arrays belong to parameters: a leaf keyed by a parameter's name takes its spec."""
    zero: bool
    """Whether ZeRO-1 splits its floating arrays over the data axes."""
    held_in: str
    """The dtype it is held in, in words (for the docs and errors)."""
    quantized: bool = False
    """Whether ``state_bits=`` may hold its running statistics as low-bit codes."""
    warm_start: bool = True
    """Whether a warm start fills it from another run's state dict (matched by field and parameter name)."""


STEP = StateChild(
    "step", "step", "step", None, per_parameter=False, zero=False, held_in="int32, saturating at 2**31 - 1"
)
OPT_STATE = StateChild(
    "opt_state", "opt_state", "opt_state", None, per_parameter=True, zero=True,
    held_in="as tx.init makes it, weak types made strong", quantized=True,
)  # fmt: skip
MASTER = StateChild("master", "master", "master", None, per_parameter=True, zero=True, held_in="master_dtype")
COMPENSATION = StateChild(
    "compensation", "compensation", "rounding", "compensation", per_parameter=True, zero=True,
    held_in="the param's dtype (float32 for a one-byte float)",
)  # fmt: skip
ROUNDING_KEY = StateChild(
    "rounding_key", "key", "rounding", "key", per_parameter=False, zero=False,
    held_in="a typed PRNG key, written as its key data",
)  # fmt: skip

EMA = StateChild(
    "ema", "ema_state", "ema", None, per_parameter=True, zero=True,
    held_in="float32, whatever the params' dtype",
)  # fmt: skip

PRECISION_CHILDREN: tuple[StateChild, ...] = (MASTER, COMPENSATION, ROUNDING_KEY)
"""The children a precision of the params may hold (:mod:`treeopt._step.precision`)."""
CHILDREN: tuple[StateChild, ...] = (STEP, OPT_STATE, *PRECISION_CHILDREN, EMA)
"""Every child, in the order of the state dict's entries."""


def views_of(children: Iterable[StateChild]) -> tuple[str, ...]:
    """The views that show ``children``, each once, in their order.

    Example:
        >>> views_of([MASTER, COMPENSATION, ROUNDING_KEY])
        ('master', 'rounding')
    """
    return tuple(dict.fromkeys(child.view for child in children))


VIEWS = views_of(PRECISION_CHILDREN)
"""The views of the precision's children (``opt.master``, ``opt.rounding``), in their order."""


NO_AVERAGE: tuple[()] = ()
"""What an optimizer without ``ema=`` holds in the EMA's place: an empty node, never ``None``, which a
tree of specs would read as a spec (replicated) of its own."""


def averaging(ema_state: object) -> TypeGuard[dict[str, Any]]:
    """Whether ``ema_state`` holds averages (a dict by name), rather than :data:`NO_AVERAGE`.

    Example:
        >>> averaging({"w": 0.0}), averaging({}), averaging(NO_AVERAGE)
        (True, True, False)
    """
    return isinstance(ema_state, dict)


def child_named(name: str) -> StateChild | None:
    """The child whose state-dict entry is ``name``; ``None``: none.

    Example:
        >>> child_named("rounding_key") is ROUNDING_KEY, child_named("checksum")
        (True, None)
    """
    return next((child for child in CHILDREN if child.name == name), None)
