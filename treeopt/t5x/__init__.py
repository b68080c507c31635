"""treeopt.t5x: a drop-in for T5X's ``t5x.optimizers``, built on :class:`treeopt.Optimizer`.

``import treeopt.t5x as optimizers`` gives the same names as
``from treeopt.t5x import optimizers``, plus the legacy Adafactor
(:class:`Adafactor`, also in :mod:`treeopt.t5x.legacy_adafactor`).
See ``docs/t5x.md`` for migrating.

Example:
    >>> import jax.numpy as jnp
    >>> import treeopt.t5x as optimizers
    >>> opt = optimizers.sgd(learning_rate=0.1).create({"w": jnp.zeros(3)})
    >>> opt = opt.apply_gradient({"w": jnp.ones(3)}, learning_rate=0.2)
    >>> opt.target["w"]
    Array([-0.2, -0.2, -0.2], dtype=float32)
"""

from treeopt.t5x import legacy_adafactor, optimizers
from treeopt.t5x.legacy_adafactor import (
    Adafactor,
    AdafactorHyperParams,
    AdafactorParamState,
    FactorDim,
    HParamMap,
    factor_name_to_factordim,
    standard_logical_factor_rules,
)
from treeopt.t5x.optimizers import *  # noqa: F403
from treeopt.t5x.optimizers import __all__ as _optimizers_all

__all__ = [
    "Adafactor",
    "AdafactorHyperParams",
    "AdafactorParamState",
    "FactorDim",
    "HParamMap",
    "factor_name_to_factordim",
    "legacy_adafactor",
    "optimizers",
    "standard_logical_factor_rules",
    *_optimizers_all,
]
