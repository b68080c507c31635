"""Case 8: many tiny leaves: the first step's time (trace, compile, run) and peak memory.

XLA:CPU's compile time and memory grow faster than linearly with the number
of leaves, for raw optax under ``jax.jit`` as for treeopt. Each variant runs
in a fresh process so that its peak resident memory is its own: raw optax's
``tx.update`` under ``jax.jit``, a user ``jax.jit`` step holding a
``treeopt.Optimizer``, and treeopt's eager ``update`` (no user jit), which
compiles one program of its own.

Run alone: ``python -m benchmarks.many_leaves 1000 5000``.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks._common import Profile, Row, run_child, with_ratios

CASE = "many_leaves"
VARIANTS = ("optax", "treeopt", "treeopt (eager)")


def _child(variant: str, n_leaves: int, opt_name: str) -> dict[str, Any]:
    """Runs in the fresh process: builds the state, times the first step, reads the peak RSS."""
    import jax

    import treeopt
    from benchmarks import models

    params, grads = models.tiny_leaves(n_leaves)
    tx = models.make_tx(opt_name)
    t0 = time.perf_counter()
    if variant == "optax":
        state: Any = tx.init(params)
        step: Any = jax.jit(models.optax_update(tx))
    else:
        state = treeopt.Optimizer(tx).init(params)
        step = jax.jit(models.treeopt_update) if variant == "treeopt" else None
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = state.update(grads, params) if step is None else step(params, grads, state)
    jax.block_until_ready(out)
    first_s = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"init_s": init_s, "first_s": first_s, "peak_mib": peak_kib / 1024}


def measure(variant: str, n_leaves: int, opt_name: str, timeout_s: float = 1800) -> dict[str, Any]:
    """One variant at one size, in a fresh Python process; ``None`` figures if it failed or ran out."""
    out = run_child("benchmarks.many_leaves", [variant, str(n_leaves), opt_name], timeout_s=timeout_s)
    return {"init_s": None, "first_s": None, "peak_mib": None, **out}


def run(profile: Profile, log: Callable[[str], None] = print) -> list[Row]:
    rows = []
    opt_name = profile.many_leaves_optimizer
    for n_leaves in profile.many_leaves_counts:
        config = f"{opt_name}, {n_leaves:,} leaves"
        for variant in VARIANTS:
            log(f"[{CASE}] {config}: {variant}")
            figures = measure(variant, n_leaves, opt_name)
            rows.append(Row(CASE, config, variant, figures["first_s"], "s", extra=figures))
    return rows


def main(argv: Sequence[str]) -> None:
    if argv and argv[0] == "--child":
        variant, n_leaves, opt_name = argv[1], int(argv[2]), argv[3]
        print(json.dumps(_child(variant, n_leaves, opt_name)))
        return
    from benchmarks._common import FULL
    from benchmarks._table import table

    counts = tuple(int(a) for a in argv) or FULL.many_leaves_counts
    profile = Profile(**{**FULL.__dict__, "many_leaves_counts": counts})
    print(table(with_ratios(run(profile, log=lambda m: print(m, file=sys.stderr)))))


if __name__ == "__main__":
    main(sys.argv[1:])
