"""The optimizer's injected hyperparameters, read and set by name (as attributes too).

:class:`HyperparameterAccess` is a base of :class:`treeopt.Optimizer`: it
reads and writes the hyperparameters ``optax.inject_hyperparams`` puts in the
optax state (:mod:`treeopt.hyperparams` finds them), and holds the rule for
attribute assignment that the drop-in shares (``hyperparams.sets_hyperparameter``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from treeopt import hyperparams as _hyperparams

__all__ = ["HyperparameterAccess"]


class HyperparameterAccess:
    """``hyperparams``, ``set_hyperparams`` and hyperparameters as attributes, over ``self.opt_state``.

    Example:
        >>> import jax.numpy as jnp, optax, treeopt
        >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        >>> opt = treeopt.Optimizer(tx).init({"w": jnp.ones(2)})
        >>> isinstance(opt, HyperparameterAccess), round(float(opt.learning_rate), 6)
        (True, 0.1)
    """

    __slots__ = ()

    if TYPE_CHECKING:
        opt_state: Any

        @property
        def layout(self) -> Any: ...

    @property
    def hyperparams(self) -> dict[str, Any]:
        """The injected hyperparameters (``optax.inject_hyperparams``) by name.

        Example:
            >>> import jax.numpy as jnp, optax, treeopt
            >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
            >>> opt = treeopt.Optimizer(tx).init({"w": jnp.ones(2)})
            >>> opt.learning_rate = 0.01      # next step uses it, no recompilation
            >>> round(float(opt.hyperparams["learning_rate"]), 6)
            0.01
        """
        self.layout  # noqa: B018 - reading it raises the error that says to call init first
        return _hyperparams.get_hyperparams(self.opt_state)

    def set_hyperparams(self, values: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        """Sets injected hyperparameters in place; qualified names (``"decay/learning_rate"``) allowed.

        Example:
            >>> import jax.numpy as jnp, optax, treeopt
            >>> tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
            >>> opt = treeopt.Optimizer(tx).init({"w": jnp.ones(2)})
            >>> opt.set_hyperparams(learning_rate=0.05, b1=0.8)
            >>> round(float(opt.b1), 3)
            0.8
        """
        self.layout  # noqa: B018 - reading it raises the error that says to call init first
        merged = {**(values or {}), **kwargs}
        new_state = _hyperparams.set_hyperparams(self.opt_state, merged)
        object.__setattr__(self, "opt_state", new_state)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: hyperparameters read as attributes.
        if name.startswith("_") or object.__getattribute__(self, "_layout") is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        found = _hyperparams.get_hyperparams(object.__getattribute__(self, "opt_state"))
        return _hyperparams.hyperparameter_attribute(self, name, found)

    def __setattr__(self, name: str, value: Any) -> None:
        # The drop-in's rule too (hyperparams.sets_hyperparameter): the optimizer's own attributes (its
        # fields and the views of its state) are managed; a hyperparameter is set in the state, and since
        # the optimizer holds no other attribute, any other name is set_hyperparams' error naming them.
        if hasattr(type(self), name):
            raise AttributeError(
                f"{type(self).__name__}.{name} is managed by the optimizer; use init/update/load_state_dict."
            )
        self.set_hyperparams({name: value})
