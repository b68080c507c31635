"""Optimizers that hold a :class:`treeopt.Optimizer` (the nnx drop-ins) in checkpoints.

The core knows nothing of the layers above it; a layer whose objects hold a
``treeopt.Optimizer`` says so by two methods: ``__treeopt_optimizer__()``
returns the optimizer it holds, and ``__treeopt_with__(opt)`` returns a copy
of itself holding ``opt``. ``save`` writes the optimizer held, and
``restore`` into such a target returns the same kind of object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def held_optimizer(opt: Any) -> tuple[Any, Callable[[Any], Any]]:
    """``(the treeopt.Optimizer in opt, wrap)``: ``wrap(restored)`` is of ``opt``'s kind.

    Example:
        >>> import jax.numpy as jnp, optax, treeopt
        >>> opt = treeopt.Optimizer(optax.sgd(0.1)).init({"w": jnp.ones(2)})
        >>> core, wrap = held_optimizer(opt)
        >>> core is opt and wrap(core) is opt
        True
    """
    get = getattr(type(opt), "__treeopt_optimizer__", None)
    if get is None:
        return opt, lambda restored: restored
    return get(opt), lambda restored: type(opt).__treeopt_with__(opt, restored)
