"""Case 4: trace + lower + compile time of the jitted train step, treeopt vs raw optax.

Each repeat wraps a fresh Python function in a fresh ``jax.jit`` (and JAX's
caches are cleared between repeats), so nothing compiled before is reused, and the variants alternate so both see the same machine load.
The median over repeats of each stage is reported; the row's value is the total.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import jax

import treeopt
from benchmarks import models
from benchmarks._common import Profile, Row, copy_tree, release
from benchmarks.train_step import aot, optax_step

CASE = "compile_time"


def fresh_treeopt_step() -> Callable[..., Any]:
    """A new function object each call (``optax_step`` already builds one per call)."""

    def step(params: Any, opt: treeopt.Optimizer, x: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(models.mlp_loss)(params, x)
        params = opt.update(grads, params)
        return params, opt, loss

    return step


def run(profile: Profile, log: Callable[[str], None] = print) -> list[Row]:
    n_layers, width, rows_in_batch, repeats = profile.compile_config
    params = models.mlp_params(n_layers, width)
    x = models.batch(width, rows_in_batch)
    rows = []
    for opt_name in profile.compile_optimizers:
        config = f"{opt_name}, {2 * n_layers:,} leaves"
        tx = models.make_tx(opt_name)
        args = {
            "optax": (copy_tree(params), tx.init(params), x),
            "treeopt": (copy_tree(params), treeopt.Optimizer(tx).init(params), x),
        }
        times: dict[str, list[dict[str, float]]] = {"optax": [], "treeopt": []}
        for r in range(repeats):
            log(f"[{CASE}] {config}: repeat {r + 1}/{repeats}")
            order = ["optax", "treeopt"] if r % 2 == 0 else ["treeopt", "optax"]
            for name in order:
                fn = optax_step(tx) if name == "optax" else fresh_treeopt_step()
                stages, _ = aot(jax.jit(fn, donate_argnums=(0, 1)), *args[name])
                times[name].append(stages)
                release()
        for name, measured in times.items():
            med = {k: statistics.median(t[k] for t in measured) for k in measured[0]}
            rows.append(Row(CASE, config, name, med["total_s"], "s", extra={**med, "repeats": repeats}))
    return rows
