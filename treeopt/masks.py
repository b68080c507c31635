"""Masks and labels from parameter names, for ``optax.masked``, ``multi_transform`` and friends.

Example:
    >>> import jax.numpy as jnp
    >>> from treeopt.masks import mask
    >>> mask("*kernel")({"dense/kernel": jnp.ones(2), "dense/bias": jnp.ones(2)})
    {'dense/bias': False, 'dense/kernel': True}
"""

from treeopt._tree.masks import labels as labels
from treeopt._tree.masks import mask as mask
from treeopt._tree.masks import name_matcher as name_matcher

__all__ = ["labels", "mask", "name_matcher"]
