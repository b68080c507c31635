"""Refusing an optimizer that a JAX transformation captured instead of receiving it as an argument.

``opt.update`` changes the optimizer in place. Under ``jax.jit``, ``vmap``,
``lax.scan`` and friends that only works when the optimizer went in as an
argument and comes back out: closed over, its new state would be a tracer
leaked out of the transformation, or silently lost. These checks run before
the state is touched, so a refused call leaves the optimizer usable.
"""

from __future__ import annotations

from typing import Any

import jax

from treeopt._compat.jax_private import current_trace, eager_or_autodiff, trace_of


def is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def concrete_or_eager_autodiff(x: Any) -> bool:
    """True for a concrete value, or a tracer of eager ``jax.grad``/``jvp`` over concrete values.

    An in-place update with those is what ``jax.grad`` of a function that
    builds its optimizer (or takes it undifferentiated and returns it as aux)
    needs. Tracers of jit/scan/shard_map staging or of vmap batching on a
    concrete optimizer mean it was captured by a closure: that stays an error.
    """
    while is_tracer(x):
        if not hasattr(x, "primal"):  # JVPTracer / LinearizeTracer carry their primal
            return False
        x = x.primal
    return True


CAPTURED = (
    "Optimizer.update was called inside a JAX transformation (jax.jit, lax.scan, vmap, ...) "
    "on an optimizer that was not passed into it: its state is concrete, so updating it in "
    "place would leak tracers (or, under vmap, apply one update for the whole batch). Its "
    "state is unchanged. Pass the optimizer as an argument and return it:\n"
    "    @jax.jit\n"
    "    def train_step(params, opt, batch):\n"
    "        grads = jax.grad(loss_fn)(params, batch)\n"
    "        params = opt.update(grads, params)\n"
    "        return params, opt"
)

_FOREIGN_TRACE = (
    "Optimizer.update was called inside an inner JAX transformation (a nested jax.jit, "
    "lax.scan body, vmap, ...) that closes over an optimizer traced by an outer one: its "
    "new state would belong to the inner trace and leak out of it. Pass the optimizer into "
    "the inner function and return it, e.g. carry it through lax.scan."
)

def refuse_capture(inputs: Any) -> None:
    """Raises before touching the state when a concrete optimizer is updated inside a transformation."""
    if not all(concrete_or_eager_autodiff(x) for x in jax.tree.leaves(inputs)):
        raise RuntimeError(CAPTURED)
    trace = current_trace()
    if trace is not None and not eager_or_autodiff(trace):  # eager, or eager jax.grad of a function holding it
        raise RuntimeError(CAPTURED)


def refuse_foreign_trace(step: Any) -> None:
    """Raises when the optimizer's tracers belong to an outer trace than the one now active."""
    trace = current_trace()
    own = trace_of(step)
    if trace is None or own is None or trace is own:
        return
    if not eager_or_autodiff(trace):
        raise RuntimeError(_FOREIGN_TRACE)
