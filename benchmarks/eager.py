"""Case 3: ``update`` called eagerly, with no ``jax.jit`` written by the user.

Raw optax run eagerly dispatches every small op of the update one by one
(several per leaf); treeopt's eager ``update`` runs one compiled program per
(transformation, params layout). For context, ``flax.nnx.Optimizer.update``
eagerly and the raw optax update under ``jax.jit`` are shown too. Gradients are
computed once beforehand: only the optimizer step is timed. Every variant
blocks on all of its new params and state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

import treeopt
from benchmarks import models
from benchmarks._common import (
    Profile,
    Row,
    Stepper,
    copy_tree,
    first_call,
    interleaved,
    median_ms,
    release,
    spread,
)

CASE = "eager_update"


class OptaxEager:
    def __init__(self, tx: optax.GradientTransformation, params: Any, grads: Any):
        self.tx, self.params, self.grads, self.state = tx, copy_tree(params), grads, tx.init(params)

    def step(self) -> Any:
        updates, self.state = self.tx.update(self.grads, self.state, self.params)
        self.params = optax.apply_updates(self.params, updates)
        return self.params, self.state


class OptaxJit(OptaxEager):
    def __init__(self, tx: optax.GradientTransformation, params: Any, grads: Any):
        super().__init__(tx, params, grads)

        def update(params: Any, grads: Any, state: Any) -> Any:
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        self.update = jax.jit(update, donate_argnums=(0, 2))

    def step(self) -> Any:
        self.params, self.state = self.update(self.params, self.grads, self.state)
        return self.params, self.state


class TreeoptEager:
    def __init__(self, tx: optax.GradientTransformation, params: Any, grads: Any):
        self.opt = treeopt.Optimizer(tx).init(params)
        self.params, self.grads = copy_tree(params), grads

    def step(self) -> Any:
        self.params = self.opt.update(self.grads, self.params)
        return self.params, self.opt


class NnxEager:
    def __init__(self, tx: optax.GradientTransformation, params: Any, x: jax.Array):
        from flax import nnx

        self.model = models.nnx_mlp(params)
        self.optimizer = nnx.Optimizer(self.model, tx, wrt=nnx.Param)
        self.grads = nnx.grad(lambda m: m.loss(x))(self.model)
        self.state = nnx.state((self.model, self.optimizer))

    def step(self) -> Any:
        self.optimizer.update(self.model, self.grads)
        return self.state


def run(profile: Profile, log: Callable[[str], None] = print) -> list[Row]:
    n_layers, width, slow_steps, fast_steps = profile.eager_config
    params = models.mlp_params(n_layers, width)
    x = models.batch(width, 8)
    grads = jax.grad(models.mlp_loss)(params, x)
    rows = []
    for opt_name in profile.eager_optimizers:
        config = f"{opt_name}, {2 * n_layers:,} leaves"
        tx = models.make_tx(opt_name)
        log(f"[{CASE}] {config}: timing")
        steppers = [
            Stepper("optax", OptaxEager(tx, params, grads).step, per_round=slow_steps),
            Stepper("treeopt", TreeoptEager(tx, params, grads).step, per_round=fast_steps),
        ]
        if profile.nnx:
            steppers.append(Stepper("nnx.Optimizer", NnxEager(tx, params, x).step, per_round=slow_steps))
        steppers.append(Stepper("optax (jax.jit)", OptaxJit(tx, params, grads).step, per_round=fast_steps))
        for s in steppers:
            first_call(s)
        interleaved(steppers, warmup=1, rounds=3, per_round=fast_steps)
        for s in steppers:
            extra = {"first_call_s": s.first_call_s, **spread(s.times)}
            rows.append(Row(CASE, config, s.name, median_ms(s.times), "ms", extra=extra))
        del steppers
        release()
    return rows
