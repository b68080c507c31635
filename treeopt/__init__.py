"""treeopt: an optax optimizer that is a PyTree holding its own state.

Example:
    >>> import jax, jax.numpy as jnp, optax, treeopt
    >>> params = {"w": jnp.ones(3)}
    >>> opt = treeopt.Optimizer(optax.adam(1e-3)).init(params)
    >>> params = opt.update(jax.grad(lambda p: jnp.sum(p["w"] ** 2))(params), params)
"""

from treeopt import (  # serialization registers Optimizer with flax
    checkpoint,
    errors,
    keys,
    partitioning,
    serialization,
    step,
    typing,
)
from treeopt._sharding.whole_leaf import whole_leaf
from treeopt._tree.masks import labels, mask, name_matcher
from treeopt._tree.paths import leaf_names
from treeopt.hyperparams import get_hyperparams, set_hyperparams
from treeopt.optimizer import Optimizer

__all__ = [
    "Optimizer",
    "checkpoint",
    "errors",
    "get_hyperparams",
    "keys",
    "labels",
    "leaf_names",
    "mask",
    "name_matcher",
    "nnx",
    "partitioning",
    "serialization",
    "set_hyperparams",
    "step",
    "typing",
    "whole_leaf",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # treeopt.nnx imports flax.nnx: loaded on first use, so `import treeopt` does not import nnx.
    if name == "nnx":
        import importlib

        return importlib.import_module("treeopt.nnx")
    raise AttributeError(f"module 'treeopt' has no attribute '{name}'")
