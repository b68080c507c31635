"""Case 10: ZeRO-1, the optimizer state split over the data-parallel axis, on 8 virtual CPU devices.

A decoder-only transformer's parameter tree (embedding, attention and MLP
kernels, layer-norm scales) is replicated over a ``data`` mesh of 8 devices,
as in plain data parallelism. The optimizer step (the update on the gradients
left by the data-parallel all-reduce, then the new params) runs under
``jax.jit`` with the optimizer's shardings from
``treeopt.partitioning.optimizer_shardings``: once with the state laid out
like the params (replicated), once with ``shard_state_over="data"``, where
each device updates its own eighth of the state and XLA all-gathers the new
params.

The figure is the optimizer state's bytes on one device (summed over device
0's shards), with its ratio to the replicated layout; the step time is
CPU-only and indicative (8 virtual devices share the host's cores). Each
variant runs in a fresh process with ``--xla_force_host_platform_device_count=8``
(the suite's own process may have one device), so its peak resident memory,
reported too, is its own.

Run alone: ``python -m benchmarks.zero``.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks._common import Profile, Row, run_child, spread

CASE = "zero"
VARIANTS = {"replicated state": None, "ZeRO over data": "data"}
DEVICES = 8


def transformer_shapes(vocab: int, d_model: int, n_layers: int, d_ff: int) -> dict[str, Any]:
    """Parameter shapes of a decoder-only transformer (no biases, T5-style)."""
    layer = {
        "attention": {name: (d_model, d_model) for name in ("query", "key", "value", "out")},
        "mlp": {"wi": (d_model, d_ff), "wo": (d_ff, d_model)},
        "pre_attention_norm": {"scale": (d_model,)},
        "pre_mlp_norm": {"scale": (d_model,)},
    }
    return {
        "embedding": (vocab, d_model),
        "layers": [layer for _ in range(n_layers)],
        "final_norm": {"scale": (d_model,)},
    }


def _child(variant: str, config: Sequence[Any], opt_name: str) -> dict[str, Any]:
    """Runs in the fresh 8-device process: builds params, grads and state on the mesh, times the step."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import treeopt
    from benchmarks import models
    from treeopt.partitioning import init_sharded, optimizer_shardings, zero_report

    _, vocab, d_model, n_layers, d_ff, warmup, steps = config
    assert jax.device_count() >= DEVICES, jax.devices()
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("data",))
    replicated = NamedSharding(mesh, P())
    shapes = transformer_shapes(vocab, d_model, n_layers, d_ff)
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    specs = jax.tree.map(lambda _: P(), shapes, is_leaf=is_shape)
    n_params = sum(int(np.prod(s)) for s in jax.tree.leaves(shapes, is_leaf=is_shape))

    def make(seed: int, scale: float) -> Any:
        keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(shapes, is_leaf=is_shape))))
        return jax.tree.map(lambda s: scale * jax.random.normal(next(keys), s), shapes, is_leaf=is_shape)

    params = jax.jit(lambda: make(0, 0.02), out_shardings=replicated)()
    grads = jax.jit(lambda: make(1, 1e-3), out_shardings=replicated)()  # as after the all-reduce
    over = VARIANTS[variant]
    tx = models.make_tx(opt_name)
    opt = init_sharded(treeopt.Optimizer(tx), params, mesh, specs, shard_state_over=over)
    opt_sh = optimizer_shardings(opt, specs, mesh, shard_state_over=over)
    param_sh = jax.tree.map(lambda _: replicated, params)

    def step(params: Any, opt: treeopt.Optimizer, grads: Any) -> Any:
        return opt.update(grads, params), opt

    compiled = (
        jax.jit(
            step,
            in_shardings=(param_sh, opt_sh, param_sh),
            out_shardings=(param_sh, opt_sh),
            donate_argnums=(0, 1),
        )
        .lower(params, opt, grads)
        .compile()
    )
    stats = compiled.memory_analysis()
    device = jax.devices()[0]

    def device0_bytes(tree: Any) -> int:
        leaves = jax.tree.leaves(tree)
        return sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device)

    state_bytes = device0_bytes(opt.opt_state)
    report = zero_report(opt, specs, mesh, "data")
    for _ in range(warmup):
        params, opt = compiled(params, opt, grads)
    jax.block_until_ready(opt.step)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        params, opt = compiled(params, opt, grads)
        jax.block_until_ready(opt.step)
        times.append(time.perf_counter() - t0)
    return {
        "n_params": n_params,
        "state_bytes_device0": state_bytes,
        "state_bytes_all_devices": sum(x.nbytes for x in jax.tree.leaves(opt.opt_state)),
        "params_bytes_device0": device0_bytes(params),
        "leaves_split": len(report.sharded) if over else 0,
        "leaves_left": len(report.unsharded) if over else len(report.leaves),
        "median_ms": statistics.median(times) * 1e3,
        **spread(times),
        "argument_size_in_bytes": int(stats.argument_size_in_bytes),
        "output_size_in_bytes": int(stats.output_size_in_bytes),
        "temp_size_in_bytes": int(stats.temp_size_in_bytes),
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
    }


def measure(variant: str, config: Sequence[Any], opt_name: str, timeout_s: float = 1800) -> dict[str, Any]:
    """One variant in a fresh Python process with 8 virtual CPU devices; ``error`` if it failed."""
    args = [variant, json.dumps(list(config)), opt_name]
    return run_child("benchmarks.zero", args, devices=DEVICES, timeout_s=timeout_s)


def run(profile: Profile, log: Callable[[str], None] = print) -> list[Row]:
    rows = []
    opt_name = profile.zero_optimizer
    for config in profile.zero_configs:
        label = config[0]
        measured = {}
        for variant in VARIANTS:
            log(f"[{CASE}] {opt_name}, {label}: {variant}")
            measured[variant] = measure(variant, config, opt_name)
        base = measured["replicated state"]
        for variant, figures in measured.items():
            state = figures.get("state_bytes_device0")
            extra = dict(figures)
            if state is not None and base.get("state_bytes_device0"):
                extra["state_vs_replicated"] = state / base["state_bytes_device0"]
                extra["time_vs_replicated"] = figures["median_ms"] / base["median_ms"]
            rows.append(
                Row(
                    CASE,
                    f"{opt_name}, {label}",
                    variant,
                    None if state is None else state / 2**20,
                    "MiB",
                    extra=extra,
                )
            )
    return rows


def main(argv: Sequence[str]) -> None:
    if argv and argv[0] == "--child":
        print(json.dumps(_child(argv[1], json.loads(argv[2]), argv[3])))
        return
    from benchmarks._common import FULL
    from benchmarks._table import table

    print(table(run(FULL, log=lambda m: print(m, file=sys.stderr))))


if __name__ == "__main__":
    main(sys.argv[1:])
