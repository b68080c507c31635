"""Shared machinery: interleaved timing, result rows, the environment record."""

from __future__ import annotations

import gc
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
import numpy as np

BASELINE = "optax"


@dataclass
class Profile:
    """How much work each case does.

    ``full`` gives the figures of docs/benchmarks.md (about an hour on 2 CPU
    cores), ``quick`` the headline ratios in a few minutes, ``smoke`` checks that
    every case runs (seconds, in the test suite).
    """

    name: str
    # case 1: (label, n_layers, width, batch, warmup, rounds, steps per round)
    train_configs: Sequence[tuple[str, int, int, int, int, int, int]]
    train_optimizers: Sequence[str]
    # case 2: (optimizer, n_leaves, warmup, rounds, steps per round)
    host_configs: Sequence[tuple[str, int, int, int, int]]
    # case 3: (n_layers, width, raw-eager steps, treeopt-eager steps)
    eager_config: tuple[int, int, int, int]
    eager_optimizers: Sequence[str]
    # case 4: (n_layers, width, batch, repeats)
    compile_config: tuple[int, int, int, int]
    compile_optimizers: Sequence[str]
    # case 6: (n_layers, width, steps, change learning rate every)
    retrace_config: tuple[int, int, int, int]
    # case 7: number of fp32 params, steps
    gpu_config: tuple[int, int]
    # case 8: leaf counts, optimizer
    many_leaves_counts: Sequence[int] = (1_000, 5_000, 10_000)
    many_leaves_optimizer: str = "adam"
    # case 9: (label, n_blocks, width, batch, warmup, rounds, steps per round)
    nnx_loop_configs: Sequence[tuple[str, int, int, int, int, int, int]] = (
        ("8 blocks x 256 (BatchNorm, Dropout)", 8, 256, 128, 3, 15, 5),
        ("64 blocks x 32 (BatchNorm, Dropout)", 64, 32, 32, 3, 10, 5),
    )
    # case 10: (label, vocab, d_model, n_layers, d_ff, warmup, timed steps), optimizer
    zero_configs: Sequence[tuple[str, int, int, int, int, int, int]] = (
        ("transformer 27M params (6 layers x 512, vocab 16k)", 16_384, 512, 6, 2_048, 2, 10),
    )
    zero_optimizer: str = "adam"
    # case 17: (layers, d_model, d_ff, timed steps): Llama 3.2 1B's matrices
    gpu_muon_config: tuple[int, int, int, int] = (16, 2048, 8192, 20)
    # case 16: (label, matrices, width, Newton-Schulz steps, warmup, timed steps)
    muon_configs: Sequence[tuple[str, int, int, int, int, int]] = (("8 matrices of 512 x 512", 8, 512, 5, 2, 10),)
    # case 16 on data=4 x model=2: (label, transformer layers of 6 matrices, d_model, Newton-Schulz steps,
    # warmup, timed steps)
    muon_2d_configs: Sequence[tuple[str, int, int, int, int, int]] = (
        ("2 layers of d=512 (12 matrices)", 2, 512, 5, 2, 10),
    )
    nnx: bool = True
    # the cases run when --cases is not given (None: every case)
    cases: Sequence[str] | None = None
    # case 1: the variants timed (None: all), and whether optax and treeopt get a second,
    # reversed pass (the close call: see train_step.two_passes)
    train_variants: Sequence[str] | None = None
    second_pass: bool = True


FULL = Profile(
    name="full",
    train_configs=(
        ("400 leaves (200 x 64x64)", 200, 64, 32, 5, 20, 5),
        ("2,000 leaves (1000 x 32x32)", 1000, 32, 32, 3, 8, 5),
        ("8 leaves (4 x 2048x2048)", 4, 2048, 8, 2, 12, 4),
    ),
    train_optimizers=("adam", "adamw", "adafactor"),
    host_configs=(
        ("adam", 400, 10, 20, 10),
        ("adam", 2_000, 5, 10, 10),
        ("sgd+momentum", 400, 10, 20, 10),
        ("sgd+momentum", 2_000, 5, 10, 10),
        ("sgd+momentum", 10_000, 3, 8, 5),
    ),
    eager_config=(200, 64, 6, 100),
    eager_optimizers=("adam", "adamw", "adafactor"),
    compile_config=(200, 64, 32, 3),
    compile_optimizers=("adam", "adamw", "adafactor"),
    retrace_config=(8, 16, 1_000, 100),
    gpu_config=(1_000_000_000, 20),
)

QUICK = Profile(
    name="quick",
    train_configs=(
        ("400 leaves (200 x 64x64)", 200, 64, 32, 3, 8, 5),
        ("2,000 leaves (1000 x 32x32)", 1000, 32, 32, 2, 4, 5),
    ),
    train_optimizers=("adam",),
    host_configs=(("adam", 400, 5, 10, 10),),
    eager_config=(200, 64, 3, 40),
    eager_optimizers=("adam",),
    compile_config=(200, 64, 32, 1),
    compile_optimizers=("adam",),
    retrace_config=(8, 16, 300, 50),
    gpu_config=(100_000_000, 10),
    cases=("train_step", "eager_update", "memory", "retraces"),
    train_variants=("optax", "treeopt", "nnx split/merge", "nnx.jit"),
    second_pass=False,
)

SMOKE = Profile(
    name="smoke",
    train_configs=(("4 leaves (2 x 4x4)", 2, 4, 2, 1, 2, 2),),
    train_optimizers=("adam",),
    host_configs=(("adam", 4, 1, 2, 2),),
    eager_config=(2, 4, 2, 2),
    eager_optimizers=("adam",),
    compile_config=(2, 4, 2, 1),
    compile_optimizers=("adam",),
    retrace_config=(2, 4, 20, 5),
    gpu_config=(1 << 12, 2),
    many_leaves_counts=(8,),
    nnx_loop_configs=(("2 blocks x 4 (BatchNorm, Dropout)", 2, 4, 4, 1, 2, 2),),
    zero_configs=(("transformer 1 layer x 16, vocab 64", 64, 16, 1, 32, 1, 2),),
    muon_configs=(("8 matrices of 32 x 32", 8, 32, 5, 1, 2),),
    muon_2d_configs=(("1 layer of d=16 (6 matrices)", 1, 16, 5, 1, 2),),
    gpu_muon_config=(2, 16, 64, 2),
)


@dataclass
class Row:
    """One measured figure: a variant of a case, for one configuration."""

    case: str
    config: str
    variant: str
    value: float | None
    unit: str
    ratio: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "case": self.case,
            "config": self.config,
            "variant": self.variant,
            "value": self.value,
            "unit": self.unit,
            "ratio_to_optax": self.ratio,
            **self.extra,
        }


def with_ratios(rows: list[Row], baseline: str = BASELINE) -> list[Row]:
    """Fills ``ratio`` of every row with its value over the baseline's value of the same config."""
    base = {(r.case, r.config): r.value for r in rows if r.variant == baseline}
    for r in rows:
        b = base.get((r.case, r.config))
        if r.value is not None and b:
            r.ratio = r.value / b
    return rows


class DonatedLoop:
    """Feeds a jitted ``fn(params, grads, state) -> (params, state)`` its own outputs, params and state
    donated as a training loop would; ``step()`` returns param ``"w0"`` to block on (see :class:`Stepper`)."""

    def __init__(self, fn: Callable[..., Any], params: Any, grads: Any, state: Any):
        self.fn, self.params, self.grads, self.state = fn, params, grads, state

    def step(self) -> Any:
        self.params, self.state = self.fn(self.params, self.grads, self.state)
        return self.params["w0"]


@dataclass
class Stepper:
    """A variant under timing: ``step()`` runs one step and returns an array to block on.

    Every output of one XLA execution becomes ready together, so blocking on a
    single output (the loss, a step counter) waits for the whole step without
    paying to walk the whole output tree.
    """

    name: str
    step: Callable[[], Any]
    per_round: int | None = None  # steps per round, where it differs from the case's
    first_call_s: float = 0.0
    times: list[float] = field(default_factory=list)


def first_call(stepper: Stepper) -> None:
    """Runs the first step (trace, compile and run) and records how long it took."""
    t0 = time.perf_counter()
    jax.block_until_ready(stepper.step())
    stepper.first_call_s = time.perf_counter() - t0


def interleaved(steppers: Sequence[Stepper], warmup: int, rounds: int, per_round: int, seed: int = 0) -> None:
    """Times every stepper side by side: ``rounds`` rounds of ``per_round`` steps each.

    Interleaving spreads any load from other processes on the machine evenly
    over the variants, so their ratios stay meaningful on a shared machine.
    The order of the variants is shuffled every round (so none always follows
    the same neighbour), and the first step after switching variants is run
    untimed. Each step is timed alone (``perf_counter`` around the call and
    ``block_until_ready``); the garbage collector is paused while timing.
    """
    for s in steppers:
        for _ in range(warmup):
            jax.block_until_ready(s.step())
    rng = random.Random(seed)
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            order = list(steppers)
            rng.shuffle(order)
            for s in order:
                step = s.step
                jax.block_until_ready(step())
                for _ in range(s.per_round or per_round):
                    t0 = time.perf_counter()
                    jax.block_until_ready(step())
                    s.times.append(time.perf_counter() - t0)
    finally:
        gc.enable()


def timed_pass(
    names: Sequence[str],
    build: Callable[[str], tuple[Stepper, dict[str, float] | None]],
    warmup: int,
    rounds: int,
    per_round: int,
) -> tuple[list[Stepper], dict[str, dict[str, float]]]:
    """Builds (and compiles) the variants in the order given, then times them side by side.

    ``build(name)`` returns the variant's :class:`Stepper` and its compile
    stages (or ``None``); each stepper's first call is timed alone
    (:func:`first_call`), then all are timed by :func:`interleaved`.
    """
    steppers, stages = [], {}
    for name in names:
        stepper, compiled = build(name)
        first_call(stepper)
        steppers.append(stepper)
        if compiled is not None:
            stages[name] = compiled
    interleaved(steppers, warmup, rounds, per_round)
    return steppers, stages


def release() -> None:
    """Drops JAX's caches of compiled programs between configurations: the large ones hold GBs."""
    jax.clear_caches()
    gc.collect()


def median_ms(times: Sequence[float]) -> float:
    return statistics.median(times) * 1e3


def spread(times: Sequence[float]) -> dict[str, float]:
    """25th and 75th percentiles in ms, to show how noisy a median was."""
    q = np.percentile(np.asarray(times) * 1e3, [25, 75])
    return {"p25_ms": float(q[0]), "p75_ms": float(q[1]), "n": len(times)}


def copy_tree(tree: Any) -> Any:
    """A device copy of every array leaf, so donating one variant's buffers cannot touch another's."""
    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded with every run."""

    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    device = jax.devices()[0]
    return {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "backend": jax.default_backend(),
        "device": device.device_kind,
        "device_count": jax.device_count(),
        **{pkg: version(pkg) for pkg in ("jax", "jaxlib", "optax", "flax", "treeopt", "numpy")},
    }


ROOT = Path(__file__).resolve().parent.parent


def run_child(
    module: str, args: Sequence[str], *, devices: int | None = None, xla_flags: Sequence[str] = (), timeout_s: float
) -> dict[str, Any]:
    """``python -m module --child *args`` in a fresh process: the JSON of its last stdout line.

    ``devices``: that many virtual CPU devices (XLA reads the flag when JAX starts,
    hence the fresh process). A failure or a timeout gives ``{"error": ...}``: the
    exception's line, or XLA's fatal log line (a collective that timed out).
    """
    env = dict(os.environ)
    if devices is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}", *xla_flags])
        env["JAX_PLATFORMS"] = "cpu"
        env.pop("JAX_NUM_CPU_DEVICES", None)
    cmd = [sys.executable, "-m", module, "--child", *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout_s:.0f} s"}
    if done.returncode != 0:
        lines = (done.stderr or "").strip().splitlines()
        errors = [line for line in lines if re.match(r"^([\w.]*(Error|Exception)\b|F\d{4} )", line)]
        return {"error": ((errors or lines)[-1:] or [f"exit {done.returncode}"])[0][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])
