"""Case 16: Muon under data parallelism on 8 virtual CPU devices: one owner a matrix, against the alternatives.

Muon's update orthogonalizes each momentum matrix by Newton-Schulz
iterations, a chain of matmuls over the whole matrix. The optimizer-only step
(the update on gradients left by the data-parallel all-reduce, then the new
params) runs, each variant in a fresh 8-device process, on two meshes.

On ``data=8``, square matrices replicated over the mesh:

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

On ``data=4 x model=2``, the matrices of transformer layers of width ``d``
under tensor parallelism: q, k, v (d x d) and the MLP's up projection
(d x 4d) split by columns over ``model``, the attention output (d x d) and the
MLP's down projection (4d x d) split by rows. Params and grads sit on the mesh
with those specs; the state is ZeRO-split over ``data`` on top of them. Here
every matrix is already cut in two, so an owner has to see the whole matrix
(or orthogonalize over both model shards) before Newton-Schulz can run: the
case measures what the split (``owned=False``) and owned variants cost on
both axis types, against raw optax on one device.

Besides the step time (CPU-only: the 8 virtual devices share the host's
cores, so an owned step should approach the one-device time), the compiled
program is read: its collectives, the bytes they bring to one device (over
the params' bytes), how many run inside a loop, and its FLOPs on one device.
Each row also counts XLA's "Involuntary full rematerialization" warnings in
its process's stderr (the SPMD partitioner printing that it had to gather a
whole array to reshard it), and checks the numbers: the largest absolute
difference of the params after one step from raw optax's on one device, from
the same params and grads.

Run alone: ``python -m benchmarks.muon`` (this case's own table, with the
columns above); in the suite: ``python -m benchmarks.run --cases muon``.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks._common import ROOT, Profile, Row, spread

CASE = "muon"
DEVICES = 8
ONE_D, TWO_D = "data=8", "data=4 x model=2"
MESHES: dict[str, tuple[int, int]] = {ONE_D: (8, 1), TWO_D: (4, 2)}
REMAT = "Involuntary full rematerialization"
# variant: (on the mesh, shard_state_over, owned, auto axes)
VARIANTS: dict[str, tuple[bool, str | None, bool, bool]] = {
    "optax, one device": (False, None, False, False),
    "treeopt replicated": (True, None, False, False),
    "treeopt ZeRO, split": (True, "data", False, False),
    "treeopt ZeRO, split, auto axes": (True, "data", False, True),
    "treeopt ZeRO, owned": (True, "data", True, False),
    "treeopt ZeRO, owned, auto axes": (True, "data", True, True),
}
# the variants run on each mesh
MESH_VARIANTS: dict[str, tuple[str, ...]] = {
    ONE_D: tuple(VARIANTS),
    TWO_D: (
        "optax, one device",
        "treeopt ZeRO, split",
        "treeopt ZeRO, owned",
        "treeopt ZeRO, split, auto axes",
        "treeopt ZeRO, owned, auto axes",
    ),
}
# a transformer layer's matrices: (rows, columns) in units of d, and the mesh axes of the params' spec
LAYER: dict[str, tuple[tuple[int, int], tuple[str | None, str | None]]] = {
    "q": ((1, 1), (None, "model")),
    "k": ((1, 1), (None, "model")),
    "v": ((1, 1), (None, "model")),
    "o": ((1, 1), ("model", None)),
    "up": ((1, 4), (None, "model")),
    "down": ((4, 1), ("model", None)),
}


def shapes_of(n_matrices: int, width: int) -> dict[str, tuple[int, int]]:
    """``n_matrices`` square kernels, as a stack of layers of one width has."""
    return {f"layer{i}/kernel": (width, width) for i in range(n_matrices)}


def model_of(mesh: str, count: int, width: int) -> dict[str, tuple[tuple[int, int], tuple[str | None, ...]]]:
    """Each matrix's shape and the mesh axes of its params' spec.

    ``data=8``: ``count`` square matrices, replicated. ``data=4 x model=2``:
    ``count`` transformer layers of width ``width`` (:data:`LAYER`).
    """
    if mesh == ONE_D:
        return {name: (shape, ()) for name, shape in shapes_of(count, width).items()}
    return {
        f"layer{i}/{name}": ((rows * width, cols * width), axes)
        for i in range(count)
        for name, ((rows, cols), axes) in LAYER.items()
    }


def _child(mesh_name: str, variant: str, config: Sequence[Any]) -> dict[str, Any]:
    """Runs in the fresh 8-device process: builds params, grads and state, reads the program, times the step."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import treeopt
    from benchmarks import _hlo
    from treeopt.partitioning import init_sharded, optimizer_shardings

    _, count, width, ns_steps, warmup, steps = config
    on_mesh, over, owned, auto = VARIANTS[variant]
    assert jax.device_count() >= DEVICES, jax.devices()
    model = model_of(mesh_name, count, width)
    shapes = {name: shape for name, (shape, _) in model.items()}
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    tx = optax.contrib.muon(1e-2, ns_steps=ns_steps)

    def make(seed: int, scale: float) -> Any:
        keys = iter(jax.random.split(jax.random.key(seed), len(shapes)))
        return {name: scale * jax.random.normal(next(keys), shape) for name, shape in shapes.items()}

    def step(params: Any, opt: Any, grads: Any) -> Any:
        return opt.update(grads, params), opt

    def raw_step(params: Any, state: Any, grads: Any) -> Any:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    if on_mesh:
        kinds = (jax.sharding.AxisType.Auto if auto else jax.sharding.AxisType.Explicit,) * 2
        data, tensor = MESHES[mesh_name]
        if tensor == 1:
            mesh = jax.make_mesh((data,), ("data",), axis_types=kinds[:1])
        else:
            mesh = jax.make_mesh((data, tensor), ("data", "model"), axis_types=kinds)
        specs = {name: P(*axes) for name, (_, axes) in model.items()}
        param_sh = {name: NamedSharding(mesh, spec) for name, spec in specs.items()}
        params = jax.jit(lambda: make(0, 0.02), out_shardings=param_sh)()
        grads = jax.jit(lambda: make(1, 1e-3), out_shardings=param_sh)()  # as after the all-reduce
        opt = init_sharded(treeopt.Optimizer(tx, owned=owned), params, mesh, specs, shard_state_over=over)
        opt_sh = optimizer_shardings(opt, specs, mesh, shard_state_over=over)
        with jax.set_mesh(mesh):
            jitted = jax.jit(step, in_shardings=(param_sh, opt_sh, param_sh), out_shardings=(param_sh, opt_sh))
            compiled = jitted.lower(params, opt, grads).compile()
    else:
        params, grads = make(0, 0.02), make(1, 1e-3)
        opt = tx.init(params)
        compiled = jax.jit(raw_step).lower(params, opt, grads).compile()
    program = _hlo.read(compiled)
    # The numbers: the first step's params against raw optax's on one device, from the same inputs.
    host_params, host_grads = jax.device_get(params), jax.device_get(grads)
    reference, _ = jax.jit(raw_step)(host_params, tx.init(host_params), host_grads)
    params, opt = compiled(params, opt, grads)
    max_abs_diff = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(jax.device_get(params)), jax.tree.leaves(reference), strict=True)
    )
    for _ in range(warmup - 1):
        params, opt = compiled(params, opt, grads)
    jax.block_until_ready(params)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        params, opt = compiled(params, opt, grads)
        jax.block_until_ready(params)
        times.append(time.perf_counter() - t0)
    return {
        "mesh": mesh_name,
        "n_params": n_params,
        "median_ms": statistics.median(times) * 1e3,
        **spread(times),
        "collectives": program.count(),
        "collectives_in_loops": len(program.in_loops()),
        "bytes_vs_params": program.bytes() / (4 * n_params),
        "flops_per_device": program.flops,
        "max_abs_diff_to_one_device": max_abs_diff,
    }


def run_counting(args: Sequence[str], timeout_s: float) -> dict[str, Any]:
    """``python -m benchmarks.muon --child *args`` with 8 virtual CPU devices, as ``run_child`` runs it,
    plus ``remat_warnings``: the lines of the child's stderr that carry XLA's :data:`REMAT` warning.

    A failure or a timeout gives ``{"error": ...}`` (and the count, where the child got that far).
    """
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={DEVICES}"])
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("JAX_NUM_CPU_DEVICES", None)
    cmd = [sys.executable, "-m", "benchmarks.muon", "--child", *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout_s:.0f} s"}
    lines = (done.stderr or "").strip().splitlines()
    remat = sum(REMAT in line for line in lines)
    if done.returncode != 0:
        errors = [line for line in lines if re.match(r"^([\w.]*(Error|Exception)\b|F\d{4} )", line)]
        return {"error": ((errors or lines)[-1:] or [f"exit {done.returncode}"])[0][:200], "remat_warnings": remat}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "remat_warnings": remat}


def measure(mesh: str, variant: str, config: Sequence[Any], timeout_s: float = 1800) -> dict[str, Any]:
    """One variant on one mesh in a fresh Python process with 8 virtual CPU devices; ``error`` if it failed."""
    return run_counting([mesh, variant, json.dumps(list(config))], timeout_s=timeout_s)


def run(profile: Profile, log: Callable[[str], None] = print) -> list[Row]:
    rows = []
    configs = [(ONE_D, c) for c in profile.muon_configs] + [(TWO_D, c) for c in profile.muon_2d_configs]
    for mesh, config in configs:
        label = f"{config[0]}, {mesh}"
        measured = {}
        for variant in MESH_VARIANTS[mesh]:
            log(f"[{CASE}] {label}: {variant}")
            measured[variant] = measure(mesh, variant, config)
        base = measured["optax, one device"]
        for variant, figures in measured.items():
            extra = {"mesh": mesh, **figures}
            if "median_ms" in figures and base.get("median_ms"):
                extra["time_vs_one_device"] = figures["median_ms"] / base["median_ms"]
                extra["flops_vs_one_device"] = figures["flops_per_device"] / base["flops_per_device"]
            rows.append(Row(CASE, label, variant, figures.get("median_ms"), "ms", extra=extra))
    return rows


COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("median_ms", "ms", "{:.1f}"),
    ("time_vs_one_device", "x 1 dev", "{:.2f}"),
    ("collectives", "coll.", "{}"),
    ("collectives_in_loops", "in loops", "{}"),
    ("bytes_vs_params", "bytes/params", "{:.2f}"),
    ("flops_vs_one_device", "FLOPs x 1 dev", "{:.3f}"),
    ("remat_warnings", "remat", "{}"),
    ("max_abs_diff_to_one_device", "max |diff|", "{:.1e}"),
)


def muon_table(rows: Sequence[Row]) -> str:
    """This case's own table: config and mesh, variant, and every figure in its column."""
    header = ["config", "variant", *(title for _, title, _ in COLUMNS), "error"]
    body = [
        [
            r.config,
            r.variant,
            *(fmt.format(r.extra[key]) if r.extra.get(key) is not None else "-" for key, _, fmt in COLUMNS),
            str(r.extra.get("error", "")),
        ]
        for r in rows
    ]
    widths = [max(len(cells[i]) for cells in [header, *body]) for i in range(len(header))]
    fmt = "  ".join(f"{{:{'<' if i < 2 else '>'}{w}}}" for i, w in enumerate(widths[:-1])) + "  {}"
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths[:-1]), "-----")]
    return "\n".join([*lines, *(fmt.format(*cells).rstrip() for cells in body)])


def main(argv: Sequence[str]) -> None:
    if argv and argv[0] == "--child":
        print(json.dumps(_child(argv[1], argv[2], json.loads(argv[3]))))
        return
    from benchmarks._common import FULL, SMOKE

    profile = SMOKE if "--smoke" in argv else FULL
    print(muon_table(run(profile, log=lambda m: print(m, file=sys.stderr, flush=True))))


if __name__ == "__main__":
    main(sys.argv[1:])
