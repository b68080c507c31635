"""Case 6: retraces over many steps while the learning rate changes every so often.

The transformation is ``optax.inject_hyperparams(optax.adam)``, so the learning
rate lives in the optimizer state and changing it must not retrace or
recompile anything. Traces and compiles are counted from JAX's own compile log
(``jax.log_compiles``), for every function JAX traces: the first step's
(which trace and compile the step, proving the count works) and all later ones.

Variants: raw optax under ``jax.jit`` (the learning rate set in
``opt_state.hyperparams`` as a float32 array), treeopt under ``jax.jit`` and
treeopt's eager ``update`` (both setting ``opt.learning_rate = lr``). The
final params of all three are compared, to show that they ran the same steps.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import treeopt
from benchmarks import models
from benchmarks._common import Profile, Row, copy_tree

CASE = "retraces"
TRACED = re.compile(r"^Finished tracing (?:\+ transforming )?(\S+)")
COMPILED = re.compile(r"^Finished XLA compilation of (\S+)")


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.traces: Counter[str] = Counter()
        self.compiles: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if m := TRACED.match(message):
            self.traces[m.group(1)] += 1
        elif m := COMPILED.match(message):
            self.compiles[m.group(1)] += 1


@contextmanager
def count_compiles() -> Iterator[_Collect]:
    """Counts traces and XLA compiles (by function name) while the block runs."""
    collect = _Collect()
    logger = logging.getLogger("jax")
    propagate = logger.propagate
    logger.addHandler(collect)
    logger.propagate = False  # count the records without printing them
    try:
        with jax.log_compiles(True):
            yield collect
    finally:
        logger.removeHandler(collect)
        logger.propagate = propagate


def learning_rate(step: int, every: int) -> float:
    return 1e-3 * 0.8 ** (step // every)


def run_optax(tx: Any, params: Any, grads: Any, steps: int, every: int, counted: Callable[[], Any]) -> Any:
    def update(params: Any, grads: Any, state: Any) -> Any:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    update = jax.jit(update, donate_argnums=(0, 2))
    params, state = copy_tree(params), tx.init(params)
    with counted() as first:
        params, state = update(params, grads, state)
    with counted() as c:
        for i in range(1, steps):
            if i % every == 0:
                state.hyperparams["learning_rate"] = jnp.asarray(learning_rate(i, every), jnp.float32)
            params, state = update(params, grads, state)
        jax.block_until_ready(params)
    return params, first, c, state.hyperparams["learning_rate"]


def run_treeopt(
    tx: Any, params: Any, grads: Any, steps: int, every: int, counted: Callable[[], Any], use_jit: bool
) -> Any:
    def update(params: Any, grads: Any, opt: treeopt.Optimizer) -> Any:
        return opt.update(grads, params), opt

    if use_jit:
        update = jax.jit(update, donate_argnums=(0, 2))
    params, opt = copy_tree(params), treeopt.Optimizer(tx).init(params)
    with counted() as first:
        params, opt = update(params, grads, opt)
    with counted() as c:
        for i in range(1, steps):
            if i % every == 0:
                opt.learning_rate = learning_rate(i, every)
            params, opt = update(params, grads, opt)
        jax.block_until_ready(params)
    return params, first, c, opt.learning_rate


def run(profile: Profile, log: Callable[[str], None] = print) -> list[Row]:
    n_layers, width, steps, every = profile.retrace_config
    params = models.mlp_params(n_layers, width)
    grads = jax.grad(models.mlp_loss)(params, models.batch(width, 4))
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=learning_rate(0, every))
    config = f"inject_hyperparams(adam), {steps:,} steps, lr changed every {every}"
    log(f"[{CASE}] {config}")
    results = {
        "optax": run_optax(tx, params, grads, steps, every, count_compiles),
        "treeopt": run_treeopt(tx, params, grads, steps, every, count_compiles, use_jit=True),
        "treeopt (eager)": run_treeopt(tx, params, grads, steps, every, count_compiles, use_jit=False),
    }
    reference = results["optax"][0]
    rows = []
    for name, (final, first, counts, lr) in results.items():
        diff = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(reference), strict=True)
        )
        extra = {
            "first_step_traces": sum(first.traces.values()),
            "first_step_compiles": sum(first.compiles.values()),
            "compiles": sum(counts.compiles.values()),
            "traced": dict(counts.traces),
            "final_learning_rate": float(lr),
            "max_abs_diff_to_optax": diff,
        }
        rows.append(Row(CASE, config, name, float(sum(counts.traces.values())), "traces", extra=extra))
    return rows
