"""Case 17 (GPU only): what one data-parallel device pays for Muon with whole-leaf ownership.

A Llama-1B-like set of matrices (16 layers of q, k, v, o ``2048 x 2048``,
gate and up ``2048 x 8192``, down ``8192 x 2048``: 1.07B params), the
optimizer-only step on one GPU, params and state donated:

- ``AdamW, all params``: the elementwise baseline;
- ``Muon, all matrices``: ``optax.contrib.muon`` as every device of a
  replicated data-parallel run computes it;
- ``Muon, one owner's share of 8``: the matrices that ownership gives device 0
  of 8 (the plan of :func:`treeopt._sharding.ownership.owners`), which is
  all its Newton-Schulz work once the state is owned.

On a machine without a GPU the case reports itself as skipped; ``force=True``
runs it anyway on a small size (the smoke test uses it to exercise the code).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

import treeopt
from benchmarks import models
from benchmarks._common import DonatedLoop, Profile, Row, Stepper, first_call, interleaved, median_ms, spread

CASE = "gpu_muon"
OWNERS = 8


def llama_like(layers: int, d_model: int, d_ff: int) -> dict[str, tuple[int, int]]:
    """The attention and MLP matrices of a Llama-like decoder, by name."""
    shapes = {}
    for layer in range(layers):
        for name in ("q", "k", "v", "o"):
            shapes[f"layers/{layer}/attention/{name}"] = (d_model, d_model)
        shapes[f"layers/{layer}/mlp/gate"] = (d_model, d_ff)
        shapes[f"layers/{layer}/mlp/up"] = (d_model, d_ff)
        shapes[f"layers/{layer}/mlp/down"] = (d_ff, d_model)
    return shapes


def owner_share(shapes: dict[str, tuple[int, int]], devices: int, device: int = 0) -> dict[str, tuple[int, int]]:
    """The matrices ``device`` of ``devices`` owns under whole-leaf ownership."""
    from treeopt._sharding.ownership import whole_leaves

    tx = optax.contrib.muon(1e-3)
    params = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in shapes.items()}
    found = whole_leaves(tx, jax.eval_shape(tx.init, params), params, devices)
    return {leaf.param: shapes[leaf.param] for leaf in found if leaf.param is not None and device in leaf.owners}


def run(profile: Profile, log: Callable[[str], None] = print, force: bool = False) -> list[Row]:
    layers, d_model, d_ff, steps = profile.gpu_muon_config
    backend = jax.default_backend()
    if backend != "gpu" and not force:
        log(f"[{CASE}] skipped: the default JAX backend is {backend!r}, not a GPU")
        return [Row(CASE, "skipped", f"no GPU (backend: {backend})", None, "ms")]
    shapes = llama_like(layers, d_model, d_ff)
    n = sum(m * k for m, k in shapes.values())
    config = f"{layers} layers of d_model {d_model}, d_ff {d_ff}: {n / 1e9:.2f}B fp32 params"
    variants = {
        "AdamW, all params": (optax.adamw(1e-3), shapes),
        "Muon, all matrices": (optax.contrib.muon(1e-3), shapes),
        f"Muon, one owner's share of {OWNERS}": (optax.contrib.muon(1e-3), owner_share(shapes, OWNERS)),
    }
    rows, reference = [], None
    for name, (tx, share) in variants.items():
        log(f"[{CASE}] {config}: {name}")
        # Named w0, w1, ... as the donated loop blocks on "w0" (the optimizer treats every name alike).
        params = {f"w{i}": jnp.full(s, 0.01, jnp.float32) for i, s in enumerate(share.values())}
        grads = {k: jnp.full_like(v, 1e-3) for k, v in params.items()}
        opt = jax.jit(treeopt.Optimizer(tx).init)(params)
        loop = DonatedLoop(jax.jit(models.treeopt_update, donate_argnums=(0, 2)), params, grads, opt)
        stepper = Stepper(name, loop.step)
        first_call(stepper)
        interleaved([stepper], warmup=2, rounds=1, per_round=steps)
        ms = median_ms(stepper.times)
        reference = reference or ms
        extra = {
            "median_ms": ms,
            "time_vs_adamw": ms / reference,
            "matrices": len(share),
            "n_params": sum(m * k for m, k in share.values()),
            "device": jax.devices()[0].device_kind,
            **spread(stepper.times),
        }
        rows.append(Row(CASE, config, name, ms, "ms", extra=extra))
        del loop, stepper, params, grads, opt
    return rows
