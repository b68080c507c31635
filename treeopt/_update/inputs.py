"""The arguments of ``Optimizer.update``: checked, flattened by name, and the way back to the caller's types.

:func:`flat_inputs` turns ``update(grads, params, ...)`` into what the pure
step (:func:`treeopt.step.flat_step`) takes: ``{name: grad}``, ``{name:
param}`` and the extra arguments, and a function that turns the step's flat
output into params (or updates) of the structure and type the caller gave
(an nnx Module updated in place). Arguments given in ``nnx.Optimizer``'s
order, the model first, are an error that says so, where
:mod:`treeopt._update.argument_order` can tell.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optax

from treeopt._tree.layout import ParamLayout, is_lookahead
from treeopt._tree.nnx_graph import is_nnx_graph
from treeopt._update.argument_order import refuse_swapped, swapped_after_mismatch, swapped_message
from treeopt._update.extra_args import as_optax_extra_args
from treeopt._update.trace_guard import is_tracer, refuse_capture, refuse_foreign_trace


class FlatInputs(NamedTuple):
    """What ``update`` hands the pure step, and how it turns the step's output into its result."""

    grads: Any
    params: Any
    extra_args: dict[str, Any]
    rebuild: Callable[[Any], Any]


def flat_inputs(
    layout: ParamLayout,
    lookahead: bool,
    step: Any,
    grads: Any,
    params: Any,
    apply_updates: bool,
    extra_args: dict[str, Any],
) -> FlatInputs:
    """The arguments of ``update``, checked and flattened by name, and how to rebuild its result."""
    if apply_updates and params is None:
        raise ValueError(
            "update(grads) with apply_updates=True needs the current params: "
            "call opt.update(grads, params), or opt.update(grads, apply_updates=False) "
            "to get the updates."
        )
    refuse_swapped(grads, params)
    grads_matched = False
    try:
        flat_grads, rebuild_grads = layout.split_grads(grads)
        grads_matched = True
        flat_params, merge_params = split_params(layout, lookahead, params)
    except ValueError:  # a mismatch: named as swapped arguments where it looks like them
        if swapped_after_mismatch(grads, params, layout, grads_matched=grads_matched):
            raise TypeError(swapped_message(grads, params)) from None
        raise
    if extra_args:
        extra_args = as_optax_extra_args(extra_args, grads, params, layout, lookahead=lookahead)
    if is_tracer(step):
        refuse_foreign_trace(step)
    else:
        refuse_capture((flat_grads, flat_params, extra_args))

    def rebuild(out: Any) -> Any:
        if apply_updates:
            return merge_params(out)
        if lookahead:
            return optax.LookaheadParams(rebuild_grads(out.fast), rebuild_grads(out.slow))
        return rebuild_grads(out)

    return FlatInputs(flat_grads, flat_params, extra_args, rebuild)


def split_params(layout: ParamLayout, lookahead: bool, params: Any) -> tuple[Any, Any]:
    """``(flat params for tx.update, merge)``; ``merge(flat)`` rebuilds params of the given type."""
    if params is None:
        return None, None
    if not lookahead:
        if is_nnx_graph(params):  # an nnx Module: updated in place, as nnx.Optimizer does
            return layout.split_module(params)
        return layout.split_params(params)
    if not is_lookahead(params):
        raise TypeError(
            "This optimizer was initialized with optax.LookaheadParams; pass params "
            f"of that type to update, got {type(params).__name__}."
        )
    fast, rebuild_fast = layout.split_params(params.fast)
    slow, rebuild_slow = layout.split_params(params.slow)

    def merge(flat: Any) -> Any:
        return optax.LookaheadParams(rebuild_fast(flat.fast), rebuild_slow(flat.slow))

    return optax.LookaheadParams(fast, slow), merge
