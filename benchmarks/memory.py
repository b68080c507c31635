"""Case 5: memory of the compiled train step with donated buffers, from XLA's ``memory_analysis()``.

treeopt keeps the optax state as plain arrays in a flat dict and donates like
raw optax does, so its step should need exactly the same output and temporary
buffers: no extra copy of the params or the state. The row's value is
``temp + output - alias`` bytes in MiB: what the step allocates beyond its
(donated) inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

import treeopt
from benchmarks import models
from benchmarks._common import Profile, Row, copy_tree, release
from benchmarks.train_step import optax_step, treeopt_step

CASE = "memory"
FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
)


def analysis(fn: Callable[..., Any], *args: Any) -> dict[str, int]:
    compiled = jax.jit(fn, donate_argnums=(0, 1)).trace(*args).lower().compile()
    stats = compiled.memory_analysis()
    return {f: int(getattr(stats, f)) for f in FIELDS}


def run(profile: Profile, log: Callable[[str], None] = print) -> list[Row]:
    rows = []
    # The smallest and the largest model of case 1: many small leaves, few large ones.
    configs = {profile.train_configs[0], profile.train_configs[-1]}
    for label, n_layers, width, rows_in_batch, *_ in sorted(configs, key=lambda c: c[1] * c[2] ** 2):
        params = models.mlp_params(n_layers, width)
        x = models.batch(width, rows_in_batch)
        for opt_name in profile.train_optimizers:
            config = f"{opt_name}, {label}"
            log(f"[{CASE}] {config}: compiling")
            tx = models.make_tx(opt_name)
            measured = {
                "optax": analysis(optax_step(tx), copy_tree(params), tx.init(params), x),
                "treeopt": analysis(treeopt_step, copy_tree(params), treeopt.Optimizer(tx).init(params), x),
            }
            for name, stats in measured.items():
                allocated = stats["temp_size_in_bytes"] + stats["output_size_in_bytes"]
                allocated -= stats["alias_size_in_bytes"]
                rows.append(Row(CASE, config, name, allocated / 2**20, "MiB", extra=stats))
            release()
    return rows
