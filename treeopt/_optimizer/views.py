"""Read-only views of the optimizer's precision: its options and the state of its children.

:class:`StateViews` is a base of :class:`treeopt.Optimizer`: ``master_dtype``
and ``param_rounding`` read the static precision, ``master`` and ``rounding``
show its state's children in the views :mod:`treeopt._tree.children`
declares for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from treeopt._tree.children import COMPENSATION, MASTER

__all__ = ["StateViews"]


class StateViews:
    """``master_dtype``, ``param_rounding``, ``master`` and ``rounding`` of an optimizer.

    Example:
        >>> import jax.numpy as jnp, optax, treeopt
        >>> opt = treeopt.Optimizer(optax.sgd(0.1), param_rounding="kahan")
        >>> opt = opt.init({"w": jnp.ones(2, jnp.bfloat16)})
        >>> opt.param_rounding, opt.master, list(opt.rounding)
        ('kahan', {}, ['compensation'])
    """

    __slots__ = ()

    if TYPE_CHECKING:
        precision: Any
        precision_state: Any

        @property
        def initialized(self) -> bool: ...

    @property
    def master_dtype(self) -> np.dtype | None:
        """The dtype of the master copies, as given to the constructor (static); ``None``: none."""
        return self.precision.master_dtype

    @property
    def param_rounding(self) -> str | None:
        """``"kahan"``, ``"stochastic"`` or ``None``, as given to the constructor (static)."""
        return self.precision.param_rounding

    @property
    def master(self) -> dict[str, jax.Array] | None:
        """The master copies ``{name: array}`` of the params narrower than ``master_dtype`` (leaves).

        ``{}`` without ``master_dtype``, ``None`` before ``init``. They are the
        values the optimizer steps; the params ``update`` returns are them cast down.

        Example: with bfloat16 params and ``master_dtype=jnp.float32``,
        ``opt.master["dense/kernel"].dtype`` is float32.
        """
        return self.precision.views(self.precision_state)[MASTER.view] if self.initialized else None

    @property
    def rounding(self) -> dict[str, Any] | None:
        """The state of ``param_rounding`` (leaves): ``{"compensation": {name: array}}`` or ``{"key": key}``.

        ``{}`` without the option, ``None`` before ``init``. In ``state_dict()`` the
        compensation buffers are under ``"compensation"``, the key under ``"rounding_key"``.
        """
        return self.precision.views(self.precision_state)[COMPENSATION.view] if self.initialized else None
