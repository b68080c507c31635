"""The arguments of ``Optimizer.update``: checked, flattened by name, and the way back to the caller's types.

:func:`flat_inputs` turns ``update(grads, params, ...)`` into what the pure
step (:func:`treeopt.step.flat_step`) takes: ``{name: grad}``, ``{name:
param}`` and the extra arguments, and a function that turns the step's flat
output into params (or updates) of the structure and type the caller gave
(an nnx Module updated in place). Arguments given in ``nnx.Optimizer``'s
order, the model first, are an error that says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax

from treeopt._extra_args import as_optax_extra_args
from treeopt._paths import is_nnx_graph, is_nnx_object
from treeopt._trace_guard import is_tracer, refuse_capture, refuse_foreign_trace
from treeopt.layout import ParamLayout, is_lookahead


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
    if params is not None and is_nnx_graph(grads) and not is_nnx_graph(params):
        raise TypeError(swapped_message(grads, params))
    flat_grads, rebuild_grads = layout.split_grads(grads)
    try:
        flat_params, merge_params = split_params(layout, lookahead, params)
    except ValueError:
        if is_nnx_object(grads) and jax.tree.structure(grads) == layout.treedef:
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


def swapped_message(grads: Any, params: Any) -> str:
    """The error for ``update`` called in ``nnx.Optimizer``'s order, the model where the grads go."""

    def what(x: Any) -> str:
        if is_nnx_graph(x):
            return f"the nnx Module {type(x).__name__}"
        if is_nnx_object(x):
            return f"an nnx {type(x).__name__}"
        return f"a {type(x).__name__}"

    return (
        "Optimizer.update takes the gradients first and the params second:\n"
        "    params = opt.update(grads, params)\n"
        "or, for an nnx Module (updated in place, as nnx.Optimizer does):\n"
        "    opt.update(grads, model)\n"
        f"It received {what(grads)} where the gradients go and {what(params)} where the params go: "
        "that is nnx.Optimizer's order, optimizer.update(model, grads). Swap the two arguments."
    )
