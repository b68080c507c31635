"""Case 13 (GPU only): achieved memory bandwidth of an adam update whose moments are 8- or 4-bit codes.

The update alone on ~1B fp32 params (8 leaves, each ``(rows, 4096)``), params
and state donated, for ``treeopt.Optimizer(optax.adam(...), state_bits=b)``
with ``b`` None (float32 moments, case 7's figure), 8 and 4. One update reads
params, grads and both moments and writes params and both moments: at least
``4 + 4 + 4`` bytes of params and grads and ``2 * 2 * b / 8`` bytes of codes per
param, plus each moment's float32 scale per block (256 elements, 128 at 4 bits)
read and written: 28 bytes per param in float32, about 16.06 in 8 bits, 14.13 in 4. The achieved
bandwidth is that lower bound over the step time: the closer to the device's
peak, the less the decoding and encoding around ``tx.update`` cost. The time
ratio to float32 moments says what the codes cost (or save) per step.

On a machine without a GPU the case reports itself as skipped; ``force=True``
runs it anyway (on a small size: the smoke test uses it to exercise the code).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import optax

import treeopt
from benchmarks import models
from benchmarks._common import DonatedLoop, Profile, Row, Stepper, first_call, interleaved, median_ms, spread

CASE = "gpu_lowbit"
N_LEAVES = 8
WIDTH = 4096  # the last axis: blocks of 256 (128 at 4 bits) divide it, so no block is padded
BLOCK = {8: 256, 4: 128}
VARIANTS: dict[str, int | None] = {"float32 moments": None, "8-bit moments": 8, "4-bit moments": 4}


def lower_bound_bytes_per_param(bits: int | None) -> float:
    """Params and grads read, params written (12 bytes), both moments read and written, scales included."""
    if bits is None:
        return 12 + 2 * 2 * 4
    return 12 + 2 * 2 * (bits / 8 + 4 / BLOCK[bits])


def run(
    profile: Profile,
    log: Callable[[str], None] = print,
    force: bool = False,
    variants: Sequence[str] = tuple(VARIANTS),
) -> list[Row]:
    n_params, steps = profile.gpu_config
    backend = jax.default_backend()
    if backend != "gpu" and not force:
        log(f"[{CASE}] skipped: the default JAX backend is {backend!r}, not a GPU")
        return [Row(CASE, "skipped", f"no GPU (backend: {backend})", None, "GB/s")]
    rows_per_leaf = max(1, n_params // N_LEAVES // WIDTH)
    n = rows_per_leaf * WIDTH * N_LEAVES

    def zeros() -> dict[str, jax.Array]:
        return {f"w{i}": jnp.zeros((rows_per_leaf, WIDTH), jnp.float32) for i in range(N_LEAVES)}

    grads = {k: jnp.full_like(v, 1e-3) for k, v in zeros().items()}
    config = f"adam, {n / 1e9:.2f}B fp32 params in {N_LEAVES} leaves of (rows, {WIDTH})"
    log(f"[{CASE}] {config}")
    tx = optax.adam(1e-3)
    rows, reference = [], None
    # One variant's buffers at a time: at ~1B params float32 moments are 8 GB.
    for name in variants:
        bits = VARIANTS[name]
        params = zeros()
        opt = jax.jit(treeopt.Optimizer(tx, state_bits=bits).init)(params)
        loop = DonatedLoop(jax.jit(models.treeopt_update, donate_argnums=(0, 2)), params, grads, opt)
        stepper = Stepper(name, loop.step)
        first_call(stepper)
        interleaved([stepper], warmup=2, rounds=1, per_round=steps)
        ms = median_ms(stepper.times)
        if bits is None:
            reference = ms
        bound = lower_bound_bytes_per_param(bits) * n
        extra = {
            "median_ms": ms,
            "time_vs_float32": ms / reference if reference else None,
            "n_params": n,
            "state_bits": bits,
            "lower_bound_bytes": bound,
            "device": jax.devices()[0].device_kind,
            **spread(stepper.times),
        }
        rows.append(Row(CASE, config, name, bound / (ms * 1e-3) / 1e9, "GB/s", extra=extra))
        del loop, stepper, params, opt
    return rows
