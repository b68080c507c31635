"""T5X's ``t5x/optimizers.py``: ``from treeopt.t5x import optimizers`` replaces ``from t5x import optimizers``.

Every name of T5X's module, with its signature and meaning:
``OptimizerState``, ``OptimizerDef``, ``Optimizer`` (and the ``OptimizerType``,
``OptimizerStateType``, ``OptimizerDefType`` aliases), ``OptaxWrapper`` with
``_OptaxWrapperHyperParams``, ``wrap_optax_optimizer`` and the wrapped optax
aliases (``chain(transformations)`` takes one sequence), ``OptaxStatePartitionRules``
and ``MultiOptimizer(traversals_and_optimizers)``. Checkpoints are T5X's.
What differs is listed in ``docs/t5x.md``: ``MultiOptimizer`` runs optax
sub-optimizers and has a state dict, logical axes derive for every optax
state, and ``honor_learning_rate=True`` (opt-in) makes optax optimizers use the
``learning_rate=`` passed to ``apply_gradient``, which T5X ignores.

Example:
    >>> import jax.numpy as jnp
    >>> from treeopt.t5x import optimizers
    >>> opt = optimizers.adamw(learning_rate=0.1).create({"dense": {"kernel": jnp.ones((2, 2))}})
    >>> opt = opt.apply_gradient({"dense": {"kernel": jnp.ones((2, 2))}})
    >>> int(opt.state.step), sorted(opt.state_dict()["state"]["param_states"]["0"])
    (1, ['count', 'mu', 'nu'])
"""

from typing import Any

import flax.core

from treeopt.t5x._base import (
    Optimizer,
    OptimizerDef,
    OptimizerDefType,
    OptimizerState,
    OptimizerStateType,
    OptimizerType,
)
from treeopt.t5x._multi import MultiOptimizer
from treeopt.t5x._optax import (
    OptaxWrapper,
    adabelief,
    adadelta,
    adagrad,
    adam,
    adamax,
    adamaxw,
    adamw,
    adan,
    amsgrad,
    chain,
    dpsgd,
    fromage,
    lamb,
    lars,
    lion,
    nadam,
    nadamw,
    noisy_sgd,
    novograd,
    optimistic_adam_v2,
    optimistic_gradient_descent,
    radam,
    rmsprop,
    rprop,
    sgd,
    sign_sgd,
    signum,
    sm3,
    wrap_optax_optimizer,
    yogi,
)
from treeopt.t5x._optax import (
    _OptaxWrapperHyperParams as _OptaxWrapperHyperParams,
)
from treeopt.t5x._partition_rules import OptaxStatePartitionRules
from treeopt.t5x._partition_rules import _scale_by_schedule_ctor as _scale_by_schedule_ctor

freeze = flax.core.frozen_dict.freeze
unfreeze = flax.core.frozen_dict.unfreeze
Dtype = Any

__all__ = [
    "MultiOptimizer",
    "OptaxStatePartitionRules",
    "OptaxWrapper",
    "Optimizer",
    "OptimizerDef",
    "OptimizerDefType",
    "OptimizerState",
    "OptimizerStateType",
    "OptimizerType",
    "adabelief",
    "adadelta",
    "adagrad",
    "adam",
    "adamax",
    "adamaxw",
    "adamw",
    "adan",
    "amsgrad",
    "chain",
    "dpsgd",
    "fromage",
    "lamb",
    "lars",
    "lion",
    "nadam",
    "nadamw",
    "noisy_sgd",
    "novograd",
    "optimistic_adam_v2",
    "optimistic_gradient_descent",
    "radam",
    "rmsprop",
    "rprop",
    "sgd",
    "sign_sgd",
    "signum",
    "sm3",
    "wrap_optax_optimizer",
    "yogi",
]
