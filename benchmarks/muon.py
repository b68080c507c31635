"""Case 16: Muon under data parallelism on 8 virtual CPU devices: one owner a matrix, against the alternatives.

Muon's update orthogonalizes each momentum matrix by Newton-Schulz
iterations, a chain of matmuls over the whole matrix. The optimizer-only step
(the update on gradients left by the data-parallel all-reduce, then the new
params) runs, each variant in a fresh 8-device process, as:

- ``optax, one device``: ``optax.contrib.muon`` on one device, the cost every
  data-parallel device would pay with no sharding at all;
- ``treeopt replicated``: the state replicated and every device computing
  every matrix (``owned=False``), as data parallelism does by default;
- ``treeopt ZeRO, split``: the state split over ``data`` element by element
  (``owned=False``): on explicit axes (``jax.make_mesh``'s default) each
  device gathers the momenta and computes every matrix; on auto axes the
  compiler splits optax's matmuls and moves slices at every Newton-Schulz
  iteration;
- ``treeopt ZeRO, owned``: the state split over ``data`` and each matrix
  computed by one owner (the default), on both axis types.

Besides the step time (CPU-only: the 8 virtual devices share the host's
cores, so an owned step should approach the one-device time), the compiled
program is read: its collectives, the bytes they bring to one device (over
the params' bytes), how many run inside a loop, and its FLOPs on one device.

Run alone: ``python -m benchmarks.muon``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks._common import Profile, Row, run_child, spread

CASE = "muon"
DEVICES = 8
# variant: (on the mesh, shard_state_over, owned, auto axes)
VARIANTS: dict[str, tuple[bool, str | None, bool, bool]] = {
    "optax, one device": (False, None, False, False),
    "treeopt replicated": (True, None, False, False),
    "treeopt ZeRO, split": (True, "data", False, False),
    "treeopt ZeRO, split, auto axes": (True, "data", False, True),
    "treeopt ZeRO, owned": (True, "data", True, False),
    "treeopt ZeRO, owned, auto axes": (True, "data", True, True),
}


def shapes_of(n_matrices: int, width: int) -> dict[str, tuple[int, int]]:
    """``n_matrices`` square kernels, as a stack of layers of one width has."""
    return {f"layer{i}/kernel": (width, width) for i in range(n_matrices)}


def _child(variant: str, config: Sequence[Any]) -> dict[str, Any]:
    """Runs in the fresh 8-device process: builds params, grads and state, reads the program, times the step."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import treeopt
    from benchmarks import _hlo
    from treeopt.partitioning import init_sharded, optimizer_shardings

    _, n_matrices, width, ns_steps, warmup, steps = config
    on_mesh, over, owned, auto = VARIANTS[variant]
    assert jax.device_count() >= DEVICES, jax.devices()
    shapes = shapes_of(n_matrices, width)
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    tx = optax.contrib.muon(1e-2, ns_steps=ns_steps)

    def make(seed: int, scale: float) -> Any:
        keys = iter(jax.random.split(jax.random.key(seed), len(shapes)))
        return {name: scale * jax.random.normal(next(keys), shape) for name, shape in shapes.items()}

    def step(params: Any, opt: Any, grads: Any) -> Any:
        return opt.update(grads, params), opt

    if on_mesh:
        kinds = (jax.sharding.AxisType.Auto,) if auto else (jax.sharding.AxisType.Explicit,)
        mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=kinds)
        specs = {name: P() for name in shapes}
        param_sh = {name: NamedSharding(mesh, P()) for name in shapes}
        params = jax.jit(lambda: make(0, 0.02), out_shardings=param_sh)()
        grads = jax.jit(lambda: make(1, 1e-3), out_shardings=param_sh)()  # as after the all-reduce
        opt = init_sharded(treeopt.Optimizer(tx, owned=owned), params, mesh, specs, shard_state_over=over)
        opt_sh = optimizer_shardings(opt, specs, mesh, shard_state_over=over)
        with jax.set_mesh(mesh):
            jitted = jax.jit(step, in_shardings=(param_sh, opt_sh, param_sh), out_shardings=(param_sh, opt_sh))
            compiled = jitted.lower(params, opt, grads).compile()
    else:
        params, grads = make(0, 0.02), make(1, 1e-3)
        raw = tx.init(params)

        def raw_step(params: Any, state: Any, grads: Any) -> Any:
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        compiled = jax.jit(raw_step).lower(params, raw, grads).compile()
        opt = raw
    program = _hlo.read(compiled)
    for _ in range(warmup):
        params, opt = compiled(params, opt, grads)
    jax.block_until_ready(params)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        params, opt = compiled(params, opt, grads)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - t0)
    return {
        "n_params": n_params,
        "median_ms": statistics.median(times) * 1e3,
        **spread(times),
        "collectives": program.count(),
        "collectives_in_loops": len(program.in_loops()),
        "bytes_vs_params": program.bytes() / (4 * n_params),
        "flops_per_device": program.flops,
    }


def measure(variant: str, config: Sequence[Any], timeout_s: float = 1800) -> dict[str, Any]:
    """One variant in a fresh Python process with 8 virtual CPU devices; ``error`` if it failed."""
    return run_child("benchmarks.muon", [variant, json.dumps(list(config))], devices=DEVICES, timeout_s=timeout_s)


def run(profile: Profile, log: Callable[[str], None] = print) -> list[Row]:
    rows = []
    for config in profile.muon_configs:
        label = config[0]
        measured = {}
        for variant in VARIANTS:
            log(f"[{CASE}] {label}: {variant}")
            measured[variant] = measure(variant, config)
        base = measured["optax, one device"]
        for variant, figures in measured.items():
            extra = dict(figures)
            if "median_ms" in figures and base.get("median_ms"):
                extra["time_vs_one_device"] = figures["median_ms"] / base["median_ms"]
                extra["flops_vs_one_device"] = figures["flops_per_device"] / base["flops_per_device"]
            rows.append(Row(CASE, label, variant, figures.get("median_ms"), "ms", extra=extra))
    return rows


def main(argv: Sequence[str]) -> None:
    if argv and argv[0] == "--child":
        print(json.dumps(_child(argv[1], json.loads(argv[2]))))
        return
    from benchmarks._common import FULL
    from benchmarks._table import table

    print(table(run(FULL, log=lambda m: print(m, file=sys.stderr))))


if __name__ == "__main__":
    main(sys.argv[1:])
