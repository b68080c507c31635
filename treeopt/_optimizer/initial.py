"""What ``Optimizer.init`` makes of fresh params: their layout and the state's children.

Each child is made by the layer that owns it: the params' precision makes
its own state and says what ``tx.init`` sees (:mod:`treeopt._step.initial`),
``tx.init`` (wrapped for whole-leaf ownership, which checks ``owned=``) makes
the optax state, and the low-bit wing holds the children declared
quantizable (:data:`treeopt._tree.children.OPT_STATE`) as codes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from treeopt._lowbit import constant_leaves, quantized_state
from treeopt._sharding.ownership import owning
from treeopt._state.state_dict import StateParts
from treeopt._step.ema import EmaRules, fresh_ema
from treeopt._step.initial import init_inputs
from treeopt._step.step_io import strong
from treeopt._step.traced import stable_dtypes
from treeopt._step.viewed import over_names
from treeopt._tree.children import OPT_STATE
from treeopt._tree.layout import ParamLayout, Wrt, is_lookahead
from treeopt._update.trace_guard import is_tracer

__all__ = ["initial_parts"]


def initial_parts(
    tx: Any, wrt: Wrt, precision: Any, state_bits: Any, owned: Any, params: Any, ema: EmaRules = None
) -> tuple[ParamLayout, bool, StateParts]:
    """``(layout, whether params are optax.LookaheadParams, the state's parts)`` of fresh ``params``.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> from treeopt._step.precision import AS_IS
        >>> layout, _, parts = initial_parts(optax.adam(1e-3), None, AS_IS, None, (), {"w": jnp.ones(2)})
        >>> layout.names, int(parts.step), sorted(parts.opt_state[0].mu), parts.ema_state
        (('w',), 0, ['w'], ())
    """
    lookahead = is_lookahead(params)
    layout = ParamLayout.of(params.fast if lookahead else params, wrt)
    flat, precision_state = init_inputs(layout, params, lookahead, precision)
    if lookahead and ema is not None:
        raise ValueError(
            "ema= is not supported with optax.LookaheadParams (optax.lookahead): its slow "
            "params are already an average; build the optimizer without it."
        )
    ema_state = fresh_ema(ema, flat)  # the params given (a master or a float32 cast is exact)
    tx = owning(over_names(tx, layout), owned, layout.names)  # owned='s globs checked here
    opt_state = stable_dtypes(tx, jax.tree.map(strong, tx.init(flat)), flat, lookahead)
    if state_bits is not None and OPT_STATE.quantized:
        traced = any(is_tracer(x) for x in jax.tree.leaves(flat.fast if lookahead else flat))
        constants = constant_leaves(tx.init, flat) if traced else None
        opt_state = quantized_state(opt_state, layout, state_bits, constants)
    step = jnp.zeros((), jnp.int32)
    return layout, lookahead, StateParts(step, opt_state, precision_state, ema_state, precision=precision)
