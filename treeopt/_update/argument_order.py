"""``opt.update(params, grads)``: nnx.Optimizer's argument order given to treeopt's ``update(grads, params)``.

Swapped arguments are refused where something tells the two apart, before any
state changes:

- an nnx Module where the gradients go, and no Module where the params go
  (``opt.update(model, grads)``);
- after the trees failed to match the ones seen at ``init``: the tree where
  the gradients go is the params tree itself (its structure is the one
  ``init`` saw, and the params failed), or it holds nnx Variables that
  gradients do not hold (``nnx.BatchStat``, RNG state: model state) while
  the params hold none (and the gradients failed).

Nothing tells them apart where both have the same structure and leaf types:
two ``nnx.State``s of Params, two Modules of one class (``jax.grad`` of a
Module gives a Module), two dicts. Such a swapped call runs; the ``update``
docstring says so.
"""

from __future__ import annotations

from typing import Any

import jax

from treeopt._tree.layout import ParamLayout
from treeopt._tree.nnx_graph import holds_model_state, is_nnx_graph, is_nnx_object

__all__ = ["refuse_swapped", "swapped_after_mismatch", "swapped_message"]


def refuse_swapped(grads: Any, params: Any) -> None:
    """Raises ``TypeError`` for an nnx Module where the gradients go and none where the params go.

    Example:
        >>> import jax.numpy as jnp
        >>> refuse_swapped({"w": jnp.ones(2)}, {"w": jnp.ones(2)})  # dicts: nothing to tell
    """
    if params is not None and is_nnx_graph(grads) and not is_nnx_graph(params):
        raise TypeError(swapped_message(grads, params))


def swapped_after_mismatch(grads: Any, params: Any, layout: ParamLayout, *, grads_matched: bool) -> bool:
    """After ``grads`` (``grads_matched=False``) or ``params`` failed to match ``layout``: whether they look swapped.

    Only an nnx object (Module, State) where the gradients go can look
    swapped. If the gradients failed: it holds non-Param Variables (batch
    statistics, RNG state), which gradients do not hold, and the params hold
    none. If the params failed: the gradients' structure is the params tree
    ``init`` saw.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> model = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
        >>> params = nnx.state(model, nnx.Param)
        >>> layout = ParamLayout.of(params)
        >>> swapped_after_mismatch(nnx.state(model), params, layout, grads_matched=False)
        True
        >>> swapped_after_mismatch(params, {"w": jnp.ones(2)}, layout, grads_matched=True)
        True
        >>> swapped_after_mismatch({"w": jnp.ones(2)}, params, layout, grads_matched=False)
        False
    """
    if params is None or not is_nnx_object(grads):
        return False
    if grads_matched:
        return jax.tree.structure(grads) == layout.treedef
    return holds_model_state(grads) and not holds_model_state(params)


def swapped_message(grads: Any, params: Any) -> str:
    """The error for swapped arguments: the right order, for params and for an nnx Module.

    Example:
        >>> print(swapped_message({}, None).splitlines()[1])
            params = opt.update(grads, params)
    """

    def what(x: Any) -> str:
        if is_nnx_graph(x):
            return f"the nnx Module {type(x).__name__}"
        if is_nnx_object(x):
            kind = " holding model state (batch statistics, RNG state)" if holds_model_state(x) else ""
            return f"an nnx {type(x).__name__}{kind}"
        return f"a {type(x).__name__}"

    return (
        "Optimizer.update takes the gradients first and the params second:\n"
        "    params = opt.update(grads, params)\n"
        "or, for an nnx Module (updated in place, as nnx.Optimizer does):\n"
        "    opt.update(grads, model)\n"
        f"It received {what(grads)} where the gradients go and {what(params)} where the params go: "
        "that is nnx.Optimizer's order, optimizer.update(model, grads). Swap the two arguments."
    )
