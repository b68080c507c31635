"""Case 1: a jitted train step (grad of the MLP loss + optimizer update), per optimizer and model size.

Variants, all computing the same step on the same numbers:

* ``optax``: raw optax, ``jax.jit`` with donated params and state (the baseline);
* ``treeopt``: ``treeopt.Optimizer`` passed through ``jax.jit``, donated;
* ``TrainState``: ``flax.training.train_state.TrainState.apply_gradients``, donated;
* ``nnx split/merge``: ``flax.nnx.Optimizer`` with the documented functional loop
  (``nnx.split`` once, ``nnx.merge``/``nnx.state`` inside ``jax.jit``), donated;
* ``nnx.jit``: ``flax.nnx.Optimizer`` updated in place inside ``nnx.jit``, donated.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
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
    median_ms,
    release,
    spread,
    timed_pass,
)

CASE = "train_step"
Variant = tuple[Stepper, dict[str, float] | None]


class Loop:
    """Feeds a jitted ``fn(*carry, x) -> (*carry, loss)`` its own outputs, one step per call."""

    def __init__(self, fn: Callable[..., Any], carry: tuple[Any, ...], x: jax.Array):
        self.fn, self.carry, self.x = fn, carry, x

    def step(self) -> Any:
        *carry, loss = self.fn(*self.carry, self.x)
        self.carry = tuple(carry)
        return loss


def aot(jitted: Any, *args: Any) -> tuple[dict[str, float], Any]:
    """Traces, lowers and compiles ``jitted`` for ``args``, timing each stage.

    The next call of ``jitted`` with the same arguments reuses this executable.
    """
    t0 = time.perf_counter()
    traced = jitted.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    return {"trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2, "total_s": t3 - t0}, compiled


def optax_step(tx: optax.GradientTransformation) -> Callable[..., Any]:
    def step(params: Any, opt_state: Any, x: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(models.mlp_loss)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def treeopt_step(params: Any, opt: treeopt.Optimizer, x: jax.Array) -> Any:
    loss, grads = jax.value_and_grad(models.mlp_loss)(params, x)
    params = opt.update(grads, params)
    return params, opt, loss


def make_optax(tx: optax.GradientTransformation, params: Any, x: jax.Array) -> Variant:
    jitted = jax.jit(optax_step(tx), donate_argnums=(0, 1))
    carry: tuple[Any, ...] = (copy_tree(params), tx.init(params))
    stages, _ = aot(jitted, *carry, x)
    return Stepper("optax", Loop(jitted, carry, x).step), stages


def make_treeopt(tx: optax.GradientTransformation, params: Any, x: jax.Array) -> Variant:
    jitted = jax.jit(treeopt_step, donate_argnums=(0, 1))
    carry = (copy_tree(params), treeopt.Optimizer(tx).init(params))
    stages, _ = aot(jitted, *carry, x)
    return Stepper("treeopt", Loop(jitted, carry, x).step), stages


def make_train_state(tx: optax.GradientTransformation, params: Any, x: jax.Array) -> Variant:
    from flax.training import train_state

    def ts_step(state: Any, x: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(models.mlp_loss)(state.params, x)
        return state.apply_gradients(grads=grads), loss

    jitted = jax.jit(ts_step, donate_argnums=(0,))
    carry = (train_state.TrainState.create(apply_fn=models.mlp_loss, params=copy_tree(params), tx=tx),)
    stages, _ = aot(jitted, *carry, x)
    return Stepper("TrainState", Loop(jitted, carry, x).step), stages


def make_nnx_split_merge(tx: optax.GradientTransformation, params: Any, x: jax.Array) -> Variant:
    jitted, state = models.nnx_optimizer_split_merge(models.nnx_mlp(params), tx)
    stages, _ = aot(jitted, state, x)
    return Stepper("nnx split/merge", Loop(jitted, (state,), x).step), stages


def make_nnx_jit(tx: optax.GradientTransformation, params: Any, x: jax.Array) -> Variant:
    from flax import nnx

    model = models.nnx_mlp(params)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit(donate_argnums=(0, 1))
    def nnx_step(model: Any, optimizer: Any, x: jax.Array) -> Any:
        loss, grads = nnx.value_and_grad(lambda m: m.loss(x))(model)
        optimizer.update(model, grads)
        return loss

    # Compiled by its first call (first_call), in the order the variants are built.
    return Stepper("nnx.jit", lambda: nnx_step(model, optimizer, x)), None


VARIANTS: dict[str, Callable[..., Variant]] = {
    "optax": make_optax,
    "treeopt": make_treeopt,
    "TrainState": make_train_state,
    "nnx split/merge": make_nnx_split_merge,
    "nnx.jit": make_nnx_jit,
}


def two_passes(
    names: Sequence[str],
    build: Callable[[str], Variant],
    warmup: int,
    rounds: int,
    per_round: int,
    log: Callable[[str], None],
    config: str,
    second_pass: bool = True,
) -> dict[str, dict[str, Any]]:
    """Times ``names`` in one pass, then the first two (optax, treeopt) again in the opposite order.

    On this CPU a program compiled earlier in a process runs a few percent
    faster than one compiled later (up to ~15 % on dispatch-bound steps), so
    optax and treeopt are each measured once compiled first and once second,
    and their samples pooled. The other variants are compiled after them.
    """
    log(f"[{CASE}] {config}: pass 1 ({', '.join(names)})")
    first, stages = timed_pass(names, build, warmup, rounds, per_round)
    by_name = {s.name: {"times": list(s.times), "first_call_s": s.first_call_s} for s in first}
    for name, st in stages.items():
        by_name[name].update(st)
    del first
    release()
    if not second_pass:
        return by_name
    pair = list(reversed(names[:2]))
    log(f"[{CASE}] {config}: pass 2 ({', '.join(pair)})")
    second, _ = timed_pass(pair, build, warmup, rounds, per_round)
    base = {s.name: median_ms(s.times) for s in second}
    pass1 = {n: median_ms(by_name[n]["times"]) for n in pair}
    for s in second:
        by_name[s.name]["times"] += s.times
        by_name[s.name]["ratio_pass1"] = pass1[s.name] / pass1[names[0]]
        by_name[s.name]["ratio_pass2"] = base[s.name] / base[names[0]]
    del second
    release()
    return by_name


def measured_rows(case: str, config: str, by_name: dict[str, dict[str, Any]]) -> list[Row]:
    rows = []
    for name, m in by_name.items():
        times = m.pop("times")
        rows.append(Row(case, config, name, median_ms(times), "ms", extra={**m, **spread(times)}))
    return rows


def run(profile: Profile, log: Callable[[str], None] = print) -> list[Row]:
    rows = []
    names = [
        n
        for n in VARIANTS
        if (profile.nnx or not n.startswith("nnx"))
        and (profile.train_variants is None or n in profile.train_variants)
    ]
    for label, n_layers, width, rows_in_batch, warmup, rounds, per_round in profile.train_configs:
        params = models.mlp_params(n_layers, width)
        x = models.batch(width, rows_in_batch)
        for opt_name in profile.train_optimizers:
            config = f"{opt_name}, {label}"
            tx = models.make_tx(opt_name)
            by_name = two_passes(
                names,
                lambda name, tx=tx, params=params, x=x: VARIANTS[name](tx, params, x),
                warmup,
                rounds,
                per_round,
                log,
                config,
                profile.second_pass,
            )
            rows.extend(measured_rows(CASE, config, by_name))
    return rows
