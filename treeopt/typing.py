"""The types on treeopt's public signatures, named as optax names its own.

They are aliases: documentation for the reader and the type checker, with no
runtime checks of their own.

Example:
    >>> import jax.numpy as jnp
    >>> from treeopt.typing import FlatParams
    >>> flat: FlatParams = {"dense/kernel": jnp.zeros((2, 3))}
"""

from __future__ import annotations

from typing import Any, TypeAlias

import jax

__all__ = ["FlatParams", "Params", "StateDict", "Updates"]

Params: TypeAlias = Any
"""A pytree of parameters: nested dicts, a flax ``FrozenDict``, an nnx Module or
``State``, an equinox Module, ... Its trained leaves are floating-point arrays."""

Updates: TypeAlias = Params
"""Gradients or updates: a tree shaped like the params."""

FlatParams: TypeAlias = dict[str, jax.Array]
"""Trained leaves by parameter name (``"dense/kernel"``), as the optimizer runs optax on them."""

StateDict: TypeAlias = dict[str, Any]
"""Nested plain dicts of arrays keyed by state field and parameter name: ``opt.state_dict()``."""
