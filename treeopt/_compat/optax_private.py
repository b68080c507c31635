"""The one home of optax's private members treeopt reads: each function says what it stands in for.

``optax.MultiSteps`` takes its inner transformation and settings at
construction and keeps them as private attributes, with no public way to
read them back. Whole-leaf ownership rebuilds the accumulation around an
owned inner transformation, so it reads them here.

Example:
    >>> import optax
    >>> parts = multi_steps_parts(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=4))
    >>> parts.every_k_schedule(0), parts.use_grad_mean
    (4, True)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optax

__all__ = ["MultiStepsParts", "multi_steps_parts"]


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
