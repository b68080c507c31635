"""The types on treeopt's public signatures, named as optax names its own.

They are aliases: documentation for the reader and the type checker, with no
runtime checks of their own.

Example:
    >>> import jax.numpy as jnp
    >>> from treeopt.typing import FlatParams
    >>> flat: FlatParams = {"dense/kernel": jnp.zeros((2, 3))}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import jax
import optax

__all__ = ["FlatParams", "OptState", "ParamSpecs", "Params", "StateDict", "TreeFn", "Updates"]

Params: TypeAlias = Any
"""A pytree of parameters: nested dicts, a flax ``FrozenDict``, an nnx Module or
``State``, an equinox Module, ... Its trained leaves are floating-point arrays."""

Updates: TypeAlias = Params
"""Gradients or updates: a tree shaped like the params."""

FlatParams: TypeAlias = dict[str, jax.Array]
"""Trained leaves by parameter name (``"dense/kernel"``), as the optimizer runs optax on them."""

StateDict: TypeAlias = dict[str, Any]
"""Nested plain dicts of arrays keyed by state field and parameter name: ``opt.state_dict()``."""

OptState: TypeAlias = optax.OptState
"""An optax state: what ``tx.init`` returns, here over the flat ``{name: param}`` dict (``opt.opt_state``)."""

ParamSpecs: TypeAlias = Any
"""A tree shaped like the params (or the flat ``{name: spec}`` dict) with a
``jax.sharding.PartitionSpec``, or ``None`` for replicated, at each parameter."""

TreeFn: TypeAlias = Callable[[Params], Any]
"""A function of a params tree that returns a tree of the same shape: a mask
(``bool`` leaves) or labels (``str`` leaves), as optax takes them."""
