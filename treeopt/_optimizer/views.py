"""Read-only views of the optimizer's state children: the precision's, and the average of the params.

:class:`StateViews` is a base of :class:`treeopt.Optimizer`: ``master_dtype``
and ``param_rounding`` read the static precision, ``master`` and ``rounding``
show its state's children in the views :mod:`treeopt._tree.children`
declares for them, ``ema`` and ``ema_params`` the average of ``ema=``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from treeopt._tree.children import COMPENSATION, MASTER, averaging

__all__ = ["StateViews"]


class StateViews:
    """``master_dtype``, ``param_rounding``, ``master``, ``rounding``, ``ema`` and ``ema_params`` of an optimizer.

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
        ema_state: Any

        @property
        def layout(self) -> Any: ...

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

    @property
    def ema(self) -> dict[str, jax.Array] | None:
        """The averages ``{name: float32 array}`` of ``ema=`` (leaves), as :attr:`master` shows the masters.

        ``{}`` without ``ema=``, ``None`` before ``init``. Each starts as its
        param given to ``init`` and moves after each update:
        ``ema <- decay * ema + (1 - decay) * new``, ``new`` the param's exact
        new value (its master copy where it has one).

        Example:
            >>> import jax.numpy as jnp, optax, treeopt
            >>> opt = treeopt.Optimizer(optax.sgd(1.0), ema=0.9).init({"w": jnp.zeros(2)})
            >>> _ = opt.update({"w": jnp.ones(2)}, {"w": jnp.zeros(2)})
            >>> [round(x, 6) for x in opt.ema["w"].tolist()]     # 0.9 * 0 + 0.1 * -1
            [-0.1, -0.1]
        """
        if not self.initialized:
            return None
        return dict(self.ema_state) if averaging(self.ema_state) else {}

    def ema_params(self, params: Any) -> Any:
        """``params`` with each averaged param replaced by its average, in the param's dtype.

        The structure and the dtypes are ``params``'; the params ``ema=`` does not
        average are kept as given. Evaluate the model with the result. An nnx
        Module is not changed: a new one holds the averages.

        Example:
            >>> import jax.numpy as jnp, optax, treeopt
            >>> params = {"w": jnp.zeros(2, jnp.bfloat16), "b": jnp.zeros(2)}
            >>> opt = treeopt.Optimizer(optax.sgd(1.0), ema={"w": 0.5, "b": None}).init(params)
            >>> params = opt.update({"w": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2)}, params)
            >>> evaluated = opt.ema_params(params)
            >>> evaluated["w"], evaluated["b"]
            (Array([-0.5, -0.5], dtype=bfloat16), Array([-1., -1.], dtype=float32))
        """
        averages = self.ema
        if averages is None:
            raise RuntimeError("ema_params needs an initialized optimizer: call `opt = opt.init(params)` first.")
        flat, merge = self.layout.split_params(params)
        return merge({name: averages[name].astype(p.dtype) if name in averages else p for name, p in flat.items()})
