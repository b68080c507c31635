"""Case 2: the optimizer step alone (no model) on tiny leaves: what the plumbing costs per call.

With arrays of a few elements the compiled work is small, so the time per step
is the host's: flattening the arguments (for treeopt, the Optimizer's own
flatten and its flat dict of named state), the jit cache lookup, the launch,
and building the outputs. Both variants are ``jax.jit`` with donated params and
state, and get the same gradients each step.

adam (two params-shaped state dicts) runs at 400 and 2,000 leaves; SGD with
momentum (one) at 400, 2,000 and 10,000. adam at 10,000 leaves is left out on
purpose: XLA:CPU's compile time and memory grow about quadratically with the
number of leaves here (the adam update over 4,000 tiny leaves compiles in
~25 s and 2.8 GB, over 10,000 in minutes and more than 20 GB), for raw optax
and treeopt alike.

Beside the step time, ``pytree_us`` times the pytree work alone in Python: one
``jax.tree.flatten`` of the step's arguments and one ``unflatten`` of its
outputs, which is what a jitted call does on the host besides dispatch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

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

CASE = "optimizer_only"


class Loop:
    """Feeds a jitted ``fn(params, grads, state) -> (params, state)`` its own outputs."""

    def __init__(self, fn: Callable[..., Any], params: Any, grads: Any, state: Any):
        self.fn, self.params, self.grads, self.state = fn, params, grads, state

    def step(self) -> Any:
        self.params, self.state = self.fn(self.params, self.grads, self.state)
        # One output of the execution: all its outputs become ready together.
        return self.params["layers"][0]["kernel"]


def pytree_cost_us(args: tuple[Any, ...], outputs: tuple[Any, ...], repeats: int = 50) -> float:
    """Median time (us) of flattening ``args`` and unflattening ``outputs`` from its leaves."""
    out_leaves, out_def = jax.tree.flatten(outputs)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.tree.flatten(args)
        out_def.unflatten(out_leaves)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def run(profile: Profile, log: Callable[[str], None] = print) -> list[Row]:
    rows = []
    for opt_name, n_leaves, warmup, rounds, per_round in profile.host_configs:
        config = f"{opt_name}, {n_leaves:,} leaves"
        tx = models.make_tx(opt_name)
        params, grads = models.tiny_leaves(n_leaves)
        log(f"[{CASE}] {config}: compiling")

        state = tx.init(params)
        raw = Loop(jax.jit(models.optax_update(tx), donate_argnums=(0, 2)), copy_tree(params), grads, state)
        pytree = {"optax": pytree_cost_us((params, grads, state), (params, state))}
        opt = treeopt.Optimizer(tx).init(params)
        tree = Loop(jax.jit(models.treeopt_update, donate_argnums=(0, 2)), copy_tree(params), grads, opt)
        pytree["treeopt"] = pytree_cost_us((params, grads, opt), (params, opt))

        steppers = [Stepper("optax", raw.step), Stepper("treeopt", tree.step)]
        for s in steppers:
            first_call(s)
        log(f"[{CASE}] {config}: timing {rounds} x {per_round} steps per variant")
        interleaved(steppers, warmup, rounds, per_round)
        for s in steppers:
            extra = {"first_call_s": s.first_call_s, "pytree_us": pytree[s.name], **spread(s.times)}
            rows.append(Row(CASE, config, s.name, median_ms(s.times), "ms", extra=extra))
        del raw, tree, steppers
        release()
    return rows
