"""treeopt.t5x: T5X's optimizer modules, built on the treeopt core.

The migration rule is the import prefix: ``from t5x import optimizers`` becomes
``from treeopt.t5x import optimizers`` and ``from t5x import adafactor``
becomes ``from treeopt.t5x import adafactor``; nothing else changes. See
``docs/t5x.md``.

Example:
    >>> import jax.numpy as jnp
    >>> from treeopt.t5x import optimizers
    >>> opt = optimizers.sgd(learning_rate=0.1).create({"w": jnp.zeros(3)})
    >>> opt = opt.apply_gradient({"w": jnp.ones(3)})
    >>> opt.target["w"]
    Array([-0.1, -0.1, -0.1], dtype=float32)
"""

from treeopt.t5x import adafactor, optimizers

__all__ = ["adafactor", "optimizers"]
