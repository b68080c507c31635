"""Refusing an optimizer whose buffers were donated to a jitted step.

``jax.jit(train_step, donate_argnums=...)`` deletes the arrays of the
optimizer passed in once the step has run; the step returns a new one.
Using the old one afterwards fails deep in JAX ("Array has been deleted"),
or, for ``state_dict()``, hands out deleted arrays that fail later. The
core checks only where that costs nothing on the hot path: ``state_dict()``
(not a per-step call) checks every leaf, and the eager ``update`` asks only
once JAX has already refused a leaf. A jitted step is never slowed.

Example:
    >>> import jax, jax.numpy as jnp, optax, treeopt
    >>> opt = treeopt.Optimizer(optax.sgd(0.1)).init({"w": jnp.ones(2)})
    >>> donated(opt)
    False
    >>> new_opt = jax.jit(lambda opt: opt, donate_argnums=0)(opt)
    >>> donated(opt), donated(new_opt)
    (True, False)
"""

from __future__ import annotations

from typing import Any

import jax

from treeopt.errors import DonatedOptimizerError

MESSAGE = (
    "This optimizer's buffers were donated to a jitted step (donate_argnums/donate_argnames) "
    "and are deleted: use the optimizer that step returned, e.g. "
    "`params, opt = train_step(params, opt, batch)`, not the one passed in. To keep the old "
    "state as well, take opt.state_dict() (or save a checkpoint) before the step, or do not "
    "donate the optimizer."
)


def donated(tree: Any) -> bool:
    """Whether any array of ``tree`` was deleted (donated); traced arrays never are."""
    return any(
        isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.is_deleted()
        for leaf in jax.tree.leaves(tree)
    )


def refuse_donated(tree: Any) -> None:
    """Raises :class:`~treeopt.errors.DonatedOptimizerError` if ``tree`` (an optimizer) was donated."""
    if donated(tree):
        raise DonatedOptimizerError(MESSAGE)
