"""Case 7 (GPU only): achieved memory bandwidth of the adam / adamw update alone on ~1B fp32 params.

One update reads params, grads, first and second moments and writes params and
both moments: at least 7 x 4 = 28 bytes per fp32 param. The achieved bandwidth
is ``28 * n_params / step time``; the closer to the device's peak, the less the
update wastes. Params and state are donated, as in a training loop.

On a machine without a GPU the case reports itself as skipped; ``force=True``
runs it anyway (on a small size: the smoke test uses it to exercise the code).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

import treeopt
from benchmarks import models
from benchmarks._common import DonatedLoop, Profile, Row, Stepper, first_call, interleaved, median_ms, spread

CASE = "gpu_bandwidth"
BYTES_PER_PARAM = 28
N_LEAVES = 8


def run(profile: Profile, log: Callable[[str], None] = print, force: bool = False) -> list[Row]:
    n_params, steps = profile.gpu_config
    backend = jax.default_backend()
    if backend != "gpu" and not force:
        log(f"[{CASE}] skipped: the default JAX backend is {backend!r}, not a GPU")
        return [Row(CASE, "skipped", f"no GPU (backend: {backend})", None, "GB/s")]
    per_leaf = n_params // N_LEAVES

    def zeros() -> dict[str, jax.Array]:
        return {f"w{i}": jnp.zeros((per_leaf,), jnp.float32) for i in range(N_LEAVES)}

    grads = {k: jnp.full_like(v, 1e-3) for k, v in zeros().items()}
    n = per_leaf * N_LEAVES
    rows = []
    for opt_name in ("adam", "adamw"):
        config = f"{opt_name}, {n / 1e9:.2f}B fp32 params in {N_LEAVES} leaves"
        log(f"[{CASE}] {config}")
        tx = models.make_tx(opt_name)
        # One variant's buffers at a time: at ~1B params each copy is 4 GB.
        for name in ("optax", "treeopt"):
            params = zeros()
            if name == "optax":
                loop = DonatedLoop(jax.jit(models.optax_update(tx), donate_argnums=(0, 2)), params, grads, tx.init(params))
            else:
                opt = treeopt.Optimizer(tx).init(params)
                loop = DonatedLoop(jax.jit(models.treeopt_update, donate_argnums=(0, 2)), params, grads, opt)
            stepper = Stepper(name, loop.step)
            first_call(stepper)
            interleaved([stepper], warmup=2, rounds=1, per_round=steps)
            ms = median_ms(stepper.times)
            extra = {
                "median_ms": ms,
                "n_params": n,
                "lower_bound_bytes": BYTES_PER_PARAM * n,
                "device": jax.devices()[0].device_kind,
                **spread(stepper.times),
            }
            rows.append(Row(CASE, config, name, BYTES_PER_PARAM * n / (ms * 1e-3) / 1e9, "GB/s", extra=extra))
            del loop, stepper, params
    return rows
