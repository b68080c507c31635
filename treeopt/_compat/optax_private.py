"""The one home of optax's private names treeopt reads: each says what it stands in for.

``optax.MultiSteps`` takes its inner transformation and settings at
construction and keeps them as private attributes, with no public way to
read them back. Whole-leaf ownership rebuilds the accumulation around an
owned inner transformation, so it reads them here.

Muon's Newton-Schulz orthogonalization reads each momentum matrix whole.
optax defines it in a private module and calls it there by name, so it is
registered here, by module and name, as a whole-leaf function
(:func:`register_whole_leaf_functions`).

The low-bit state's tables (``treeopt._lowbit.statistics``) name each state
type by the module that defines it, and optax defines some in private
modules, named here:

- :data:`OPTAX_TRANSFORM`: ``optax._src.transform``, the module of optax's
  ``scale_by_*`` transformations and their states. Some of them optax does
  not export at all (``ScaleByRmsWithCountState``,
  ``ScaleByRStdDevWithCountState``, ``ScaleByOptimisticGradientState``);
  the others it also exports as ``optax.<name>``.
- :data:`OPTAX_FACTORIZED`: ``optax._src.factorized``, where Adafactor's
  ``FactoredState`` is defined (exported too, as ``optax.FactoredState``).
- :data:`OPTAX_ADEMAMIX`: ``optax.contrib._ademamix``, where the AdEMAMix
  states are defined (``ScaleBySimplifiedAdEMAMixState`` among them, exported
  too, in ``optax.contrib``).

:data:`OPTAX_STATE_MODULES` holds these three. The docs' table of the
low-bit state lists every optax optimizer: the functions optax defines in
``optax._src.alias`` (:data:`OPTAX_ALIAS`, :func:`is_optax_alias`), as
opposed to its building blocks (``optax.scale_by_adam``, ``optax.chain``).

Example:
    >>> import importlib, optax
    >>> parts = multi_steps_parts(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=4))
    >>> parts.every_k_schedule(0), parts.use_grad_mean
    (4, True)
    >>> importlib.import_module(OPTAX_TRANSFORM).ScaleByRmsWithCountState._fields
    ('count', 'nu')
    >>> is_optax_alias(optax.adam), is_optax_alias(optax.scale_by_adam)
    (True, False)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optax

__all__ = [
    "OPTAX_ADEMAMIX",
    "OPTAX_ALIAS",
    "OPTAX_FACTORIZED",
    "OPTAX_STATE_MODULES",
    "OPTAX_TRANSFORM",
    "OPTAX_WHOLE_LEAF",
    "MultiStepsParts",
    "is_optax_alias",
    "multi_steps_parts",
    "register_whole_leaf_functions",
]

OPTAX_TRANSFORM = "optax._src.transform"
"""The private module of optax's ``scale_by_*`` transformations and their states."""
OPTAX_FACTORIZED = "optax._src.factorized"
"""The private module that defines Adafactor's ``FactoredState``."""
OPTAX_ADEMAMIX = "optax.contrib._ademamix"
"""The private module of ``optax.contrib``'s AdEMAMix states (``ScaleBySimplifiedAdEMAMixState``)."""
OPTAX_STATE_MODULES = (OPTAX_TRANSFORM, OPTAX_FACTORIZED, OPTAX_ADEMAMIX)
"""The private modules of optax that define the state types the low-bit tables name."""
OPTAX_ALIAS = "optax._src.alias"
"""The private module of optax's optimizers (``optax.adam``, ``optax.sgd``, ...), its aliases."""


def is_optax_alias(function: Any) -> bool:
    """Whether ``function`` is one of optax's optimizers, defined in :data:`OPTAX_ALIAS`, not a building block.

    Example:
        >>> import optax
        >>> is_optax_alias(optax.sgd), is_optax_alias(optax.chain)
        (True, False)
    """
    return (getattr(function, "__module__", None) or "").startswith(OPTAX_ALIAS)


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
