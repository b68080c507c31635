"""Case 9: an nnx training loop (BatchNorm + Dropout), treeopt beside ``nnx.Optimizer``.

The model is :func:`models.nnx_bn_mlp`: its forward pass moves batch
statistics and RNG counts, so every variant carries that non-Param state from
step to step. Each variant is the whole step (forward, backward, update),
written as an nnx user writes it:

* ``optax``: ``jax.jit`` over ``nnx.split`` state with a raw optax state (the
  baseline: no optimizer object at all);
* ``treeopt (jax.jit, split)``: the same with a ``treeopt.Optimizer``;
* ``nnx.Optimizer (split/merge)``: ``nnx.Optimizer`` with ``nnx.split`` once and
  ``nnx.merge`` / ``nnx.state`` inside ``jax.jit``;
* ``treeopt (nnx.jit)`` / ``nnx.Optimizer (nnx.jit)``: the Module through ``nnx.jit``;
* ``treeopt (cached_partial)`` / ``nnx.Optimizer (cached_partial)``: ``nnx.jit``
  with the Module (and ``nnx.Optimizer``) bound once by ``nnx.cached_partial``;
* ``treeopt.nnx (...)``: the drop-in ``treeopt.nnx.Optimizer`` in each of the
  three nnx styles, with the very code of the ``nnx.Optimizer`` row of that
  style and only the class swapped.

Every variant donates its state. Each row also gives its time over the
``nnx.Optimizer`` row of the same jit style (``vs_nnx_optimizer``), and whether
its first losses equal ``nnx.Optimizer``'s bit for bit (``same_losses``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

import treeopt
from benchmarks import models
from benchmarks._common import Profile, Row, Stepper, median_ms, release, spread, timed_pass

CASE = "nnx_loop"
CHECKED_LOSSES = 2  # the first steps of every variant, compared bit for bit (untimed: warmup)

# Each treeopt variant and the nnx.Optimizer variant written in the same style.
COUNTERPART = {
    "treeopt (jax.jit, split)": "nnx.Optimizer (split/merge)",
    "treeopt (nnx.jit)": "nnx.Optimizer (nnx.jit)",
    "treeopt (cached_partial)": "nnx.Optimizer (cached_partial)",
    "treeopt.nnx (split/merge)": "nnx.Optimizer (split/merge)",
    "treeopt.nnx (nnx.jit)": "nnx.Optimizer (nnx.jit)",
    "treeopt.nnx (cached_partial)": "nnx.Optimizer (cached_partial)",
}


class Recorder:
    """Calls ``step()`` (which returns the loss) and keeps the first few losses as floats."""

    def __init__(self, step: Callable[[], Any]):
        self.step_fn, self.losses = step, []

    def step(self) -> Any:
        loss = self.step_fn()
        if len(self.losses) < CHECKED_LOSSES:
            self.losses.append(float(loss))
        return loss


def _split_loss(graphdef: Any) -> Callable[..., Any]:
    from flax import nnx

    def loss_and_rest(params: Any, rest: Any, x: jax.Array) -> Any:
        model = nnx.merge(graphdef, params, rest, copy=True)
        return model.loss(x), nnx.state(model, nnx.Not(nnx.Param))

    return loss_and_rest


def make_optax(tx: optax.GradientTransformation, build: Callable[[], Any], x: jax.Array) -> Recorder:
    from flax import nnx

    graphdef, params, rest = nnx.split(build(), nnx.Param, ...)
    loss_and_rest = _split_loss(graphdef)

    def step(params: Any, rest: Any, state: Any, x: jax.Array) -> Any:
        (loss, rest), grads = jax.value_and_grad(loss_and_rest, has_aux=True)(params, rest, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), rest, state, loss

    jitted = jax.jit(step, donate_argnums=(0, 1, 2))
    carry = [params, rest, tx.init(params)]

    def run() -> Any:
        *new, loss = jitted(*carry, x)
        carry[:] = new
        return loss

    return Recorder(run)


def make_treeopt_split(tx: optax.GradientTransformation, build: Callable[[], Any], x: jax.Array) -> Recorder:
    from flax import nnx

    graphdef, params, rest = nnx.split(build(), nnx.Param, ...)
    loss_and_rest = _split_loss(graphdef)

    def step(params: Any, rest: Any, opt: treeopt.Optimizer, x: jax.Array) -> Any:
        (loss, rest), grads = jax.value_and_grad(loss_and_rest, has_aux=True)(params, rest, x)
        params = opt.update(grads, params)
        return params, rest, opt, loss

    jitted = jax.jit(step, donate_argnums=(0, 1, 2))
    carry = [params, rest, treeopt.Optimizer(tx).init(params)]

    def run() -> Any:
        *new, loss = jitted(*carry, x)
        carry[:] = new
        return loss

    return Recorder(run)


def _nnx_type() -> Any:
    from flax import nnx

    return nnx.Optimizer


def _dropin_type() -> Any:
    import treeopt.nnx

    return treeopt.nnx.Optimizer


def make_nnx_split_merge(
    tx: optax.GradientTransformation, build: Callable[[], Any], x: jax.Array, optimizer_type: Any = None
) -> Recorder:
    jitted, state = models.nnx_optimizer_split_merge(build(), tx, optimizer_type or _nnx_type())
    carry = [state]

    def run() -> Any:
        carry[0], loss = jitted(carry[0], x)
        return loss

    return Recorder(run)


def _treeopt_nnx_step() -> Any:
    from flax import nnx

    @nnx.jit(donate_argnums=(0, 1))
    def step(model: Any, opt: treeopt.Optimizer, x: jax.Array) -> Any:
        loss, grads = nnx.value_and_grad(lambda m: m.loss(x))(model)
        opt.update(grads, model)
        return loss, opt

    return step


def _nnx_optimizer_step() -> Any:
    from flax import nnx

    @nnx.jit(donate_argnums=(0, 1))
    def step(model: Any, optimizer: Any, x: jax.Array) -> Any:
        loss, grads = nnx.value_and_grad(lambda m: m.loss(x))(model)
        optimizer.update(model, grads)
        return loss

    return step


def make_treeopt_nnx_jit(tx: optax.GradientTransformation, build: Callable[[], Any], x: jax.Array) -> Recorder:
    model = build()
    step = _treeopt_nnx_step()
    holder = [treeopt.Optimizer(tx).init(model)]

    def run() -> Any:
        loss, holder[0] = step(model, holder[0], x)
        return loss

    return Recorder(run)


def make_nnx_jit(
    tx: optax.GradientTransformation, build: Callable[[], Any], x: jax.Array, optimizer_type: Any = None
) -> Recorder:
    from flax import nnx

    model = build()
    optimizer = (optimizer_type or _nnx_type())(model, tx, wrt=nnx.Param)
    step = _nnx_optimizer_step()
    return Recorder(lambda: step(model, optimizer, x))


def make_treeopt_cached(tx: optax.GradientTransformation, build: Callable[[], Any], x: jax.Array) -> Recorder:
    from flax import nnx

    model = build()
    step = nnx.cached_partial(_treeopt_nnx_step(), model)
    holder = [treeopt.Optimizer(tx).init(model)]

    def run() -> Any:
        loss, holder[0] = step(holder[0], x)
        return loss

    return Recorder(run)


def make_nnx_cached(
    tx: optax.GradientTransformation, build: Callable[[], Any], x: jax.Array, optimizer_type: Any = None
) -> Recorder:
    from flax import nnx

    model = build()
    optimizer = (optimizer_type or _nnx_type())(model, tx, wrt=nnx.Param)
    step = nnx.cached_partial(_nnx_optimizer_step(), model, optimizer)
    return Recorder(lambda: step(x))


VARIANTS: dict[str, Callable[..., Recorder]] = {
    "optax": make_optax,
    "treeopt (jax.jit, split)": make_treeopt_split,
    "nnx.Optimizer (split/merge)": make_nnx_split_merge,
    "treeopt (nnx.jit)": make_treeopt_nnx_jit,
    "nnx.Optimizer (nnx.jit)": make_nnx_jit,
    "treeopt (cached_partial)": make_treeopt_cached,
    "nnx.Optimizer (cached_partial)": make_nnx_cached,
    "treeopt.nnx (split/merge)": lambda *a: make_nnx_split_merge(*a, optimizer_type=_dropin_type()),
    "treeopt.nnx (nnx.jit)": lambda *a: make_nnx_jit(*a, optimizer_type=_dropin_type()),
    "treeopt.nnx (cached_partial)": lambda *a: make_nnx_cached(*a, optimizer_type=_dropin_type()),
}


def run(profile: Profile, log: Callable[[str], None] = print) -> list[Row]:
    if not profile.nnx:
        return []
    rows = []
    for label, n_blocks, width, batch_rows, warmup, rounds, per_round in profile.nnx_loop_configs:
        config = f"adamw, {label}"
        tx = models.make_tx("adamw")
        x = models.batch(width, batch_rows)
        log(f"[{CASE}] {config}: compiling {len(VARIANTS)} variants")
        recorders = {
            name: make(tx, lambda n=n_blocks, w=width: models.nnx_bn_mlp(n, w), x) for name, make in VARIANTS.items()
        }
        log(f"[{CASE}] {config}: timing")
        steppers, _ = timed_pass(
            list(recorders),
            lambda name, recorders=recorders: (Stepper(name, recorders[name].step), None),
            max(warmup, CHECKED_LOSSES - 1),
            rounds,
            per_round,
        )
        medians = {s.name: median_ms(s.times) for s in steppers}
        reference = recorders["nnx.Optimizer (nnx.jit)"].losses
        for s in steppers:
            extra: dict[str, Any] = {
                "first_call_s": s.first_call_s,
                "same_losses": recorders[s.name].losses == reference,
                **spread(s.times),
            }
            if s.name in COUNTERPART:
                extra["vs_nnx_optimizer"] = medians[s.name] / medians[COUNTERPART[s.name]]
            rows.append(Row(CASE, config, s.name, medians[s.name], "ms", extra=extra))
        del steppers, recorders
        release()
    return rows
