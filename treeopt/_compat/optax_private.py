"""The one home of optax's private members treeopt reads: each function says what it stands in for.

``optax.MultiSteps`` takes its inner transformation and settings at
construction and keeps them as private attributes, with no public way to
read them back. Whole-leaf ownership rebuilds the accumulation around an
owned inner transformation, so it reads them here.

Muon's Newton-Schulz orthogonalization reads each momentum matrix whole.
optax defines it in a private module and calls it there by name, so it is
registered here, by module and name, as a whole-leaf function
(:func:`register_whole_leaf_functions`).

Example:
    >>> import optax
    >>> parts = multi_steps_parts(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=4))
    >>> parts.every_k_schedule(0), parts.use_grad_mean
    (4, True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optax

__all__ = ["OPTAX_WHOLE_LEAF", "MultiStepsParts", "multi_steps_parts", "register_whole_leaf_functions"]

OPTAX_WHOLE_LEAF: tuple[dict[str, Any], ...] = (
    {
        "module": "optax.contrib._muon",
        "name": "orthogonalize_via_newton_schulz",
        "leaf": "x",
        "dimension_numbers": "dimension_numbers",
        "what": "Muon's Newton-Schulz orthogonalization",
        "transposable": True,  # optax orthogonalizes a tall matrix as its transpose
    },
)
"""optax's functions whose result for a leaf reads it whole, where optax's own code finds them by name."""


def register_whole_leaf_functions(register: Callable[..., Any]) -> None:
    """Registers each of :data:`OPTAX_WHOLE_LEAF` through ``register(module, name, **options)`` (the entry behind
    ``treeopt.whole_leaf(module=..., name=...)``); one this optax lacks is skipped, and a test says so."""
    for found in OPTAX_WHOLE_LEAF:
        options = {k: v for k, v in found.items() if k not in ("module", "name")}
        try:
            register(found["module"], found["name"], **options)
        except ValueError:  # an optax without it: nothing of it to own
            continue


class MultiStepsParts(NamedTuple):
    """What an ``optax.MultiSteps`` was built from: its constructor's arguments, in order."""

    opt: optax.GradientTransformationExtraArgs
    every_k_schedule: Any
    use_grad_mean: bool
    should_skip_update_fn: Any


def multi_steps_parts(multi: optax.MultiSteps) -> MultiStepsParts:
    """The arguments ``multi`` was built from (its inner transformation with extra-args support).

    ``optax.MultiSteps(*multi_steps_parts(multi))`` accumulates as ``multi`` does.
    """
    return MultiStepsParts(
        getattr(multi, "_opt"),  # noqa: B009 - a private member, read by name in its one home
        getattr(multi, "_every_k_schedule"),  # noqa: B009
        getattr(multi, "_use_grad_mean"),  # noqa: B009
        getattr(multi, "_should_skip_update_fn"),  # noqa: B009
    )
