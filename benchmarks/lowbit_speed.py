"""Case 14: what low-bit state costs in time, as ratios to float32 state measured in the same run.

Three measurements, each interleaved with its own float32 baseline:

- **optimizer-only step**: one jitted AdamW update (params and state donated,
  as a training loop would) on leaves large enough to be encoded, for
  ``state_bits`` None, 8 and 4; ratios to float32 state. The update reads and
  writes little else, so this is the codec's cost laid bare (a training step
  hides it behind the model's compute: case 12's ratios);
- **jitted init**: ``jax.jit(opt.init)`` of one 2048 x 2048 Adam state, trace,
  compile and run, for the same three; the codes of zeros are built, so a
  low-bit init must not take XLA much longer than a float32 one;
- **stochastic rounding**: the AdamW step of bfloat16 params with
  ``param_rounding="stochastic"`` (and ``"kahan"``), as a ratio to the plain
  bfloat16 step (round to nearest).

With the full and quick profiles it draws the ratios (:data:`FIGURE`).
Run alone: ``python -m benchmarks.lowbit_speed [smoke|quick|full]``.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

import treeopt
from benchmarks import models
from benchmarks._common import (
    FULL,
    QUICK,
    ROOT,
    SMOKE,
    DonatedLoop,
    Profile,
    Row,
    Stepper,
    copy_tree,
    interleaved,
    median_ms,
    release,
    spread,
)

CASE = "lowbit_speed"
FIGURE = ROOT / "docs/img/lowbit-speed.png"
GOALS = {"8-bit": 2.0, "4-bit": 2.5, "init": 3.0, "stochastic": 1.2}
STATE_VARIANTS: dict[str, int | None] = {"float32 state": None, "8-bit": 8, "4-bit": 4}
ROUNDING_VARIANTS: dict[str, str | None] = {"bf16, nearest": None, "stochastic": "stochastic", "kahan": "kahan"}

# (label, leaf shapes), (warmup, rounds, steps per round), init side, init repeats
CONFIGS: dict[str, dict[str, Any]] = {
    "full": {
        "steps": [
            ("4 leaves of 1024 x 1024", [(1024, 1024)] * 4),
            ("16 leaves of 512 x 512", [(512, 512)] * 16),
            ("a transformer's shapes (24 leaves, 3.1M)", [(256, 768), (256, 256), (256, 1024), (1024, 256)] * 6),
        ],
        "timing": (3, 15, 5),
        "init_side": 2048,
        "init_repeats": 3,
    },
    "quick": {
        "steps": [("4 leaves of 1024 x 1024", [(1024, 1024)] * 4)],
        "timing": (2, 8, 5),
        "init_side": 2048,
        "init_repeats": 2,
    },
    "smoke": {
        "steps": [("2 leaves of 64 x 64", [(64, 64)] * 2)],
        "timing": (1, 2, 2),
        "init_side": 64,
        "init_repeats": 1,
    },
}


def _config(profile: Profile) -> dict[str, Any]:
    return CONFIGS[profile.name if profile.name in CONFIGS else "full"]


def _leaves(shapes: Sequence[tuple[int, ...]], dtype: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    keys = jax.random.split(jax.random.key(0), len(shapes))
    params = {f"w{i}": jax.random.normal(k, s).astype(dtype) for i, (k, s) in enumerate(zip(keys, shapes, strict=True))}
    grads = {k: (v * 1e-2).astype(dtype) for k, v in params.items()}
    return params, grads


def _steppers(options: dict[str, dict[str, Any]], params: Any, grads: Any) -> list[Stepper]:
    steppers = []
    for name, kw in options.items():
        opt = jax.jit(treeopt.Optimizer(optax.adamw(1e-3), **kw).init)(params)
        loop = DonatedLoop(jax.jit(models.treeopt_update, donate_argnums=(0, 2)), copy_tree(params), grads, opt)
        steppers.append(Stepper(name, loop.step))
    return steppers


def _rows(config: str, steppers: Sequence[Stepper], baseline: str, extra: dict[str, Any]) -> list[Row]:
    base = median_ms(next(s for s in steppers if s.name == baseline).times)
    rows = []
    for s in steppers:
        ms = median_ms(s.times)
        rows.append(Row(CASE, config, s.name, ms, "ms", extra={"vs_baseline": ms / base, **spread(s.times), **extra}))
    return rows


def _init_seconds(bits: int | None, side: int) -> float:
    """Trace, compile and run of ``jax.jit(opt.init)`` for one Adam state, the compile cache cleared first."""
    release()
    params = {"w": jnp.ones((side, side))}
    t0 = time.perf_counter()
    jax.block_until_ready(jax.jit(treeopt.Optimizer(optax.adam(1e-3), state_bits=bits).init)(params))
    return time.perf_counter() - t0


def run(profile: Profile, log: Callable[[str], None] = print) -> list[Row]:
    config = _config(profile)
    warmup, rounds, per_round = config["timing"]
    rows: list[Row] = []
    for label, shapes in config["steps"]:
        log(f"[{CASE}] AdamW step, {label}")
        params, grads = _leaves(shapes, jnp.float32)
        steppers = _steppers({name: {"state_bits": bits} for name, bits in STATE_VARIANTS.items()}, params, grads)
        interleaved(steppers, warmup, rounds, per_round)
        n = sum(int(x.size) for x in params.values())
        rows += _rows(f"step: {label}", steppers, "float32 state", {"n_params": n})
        release()
    log(f"[{CASE}] jitted init of a {config['init_side']}^2 Adam state")
    times: dict[str, list[float]] = {name: [] for name in STATE_VARIANTS}
    for _ in range(config["init_repeats"]):
        for name, bits in STATE_VARIANTS.items():  # interleaved: load from other processes hits all alike
            times[name].append(_init_seconds(bits, config["init_side"]))
    base = statistics.median(times["float32 state"])
    for name, seconds in times.items():
        s = statistics.median(seconds)
        rows.append(Row(CASE, f"init: {config['init_side']}^2 Adam state", name, s * 1e3, "ms", extra={"vs_baseline": s / base}))
    label, shapes = config["steps"][0]
    log(f"[{CASE}] bfloat16 params: stochastic rounding and Kahan, {label}")
    params, grads = _leaves(shapes, jnp.bfloat16)
    steppers = _steppers({name: {"param_rounding": mode} for name, mode in ROUNDING_VARIANTS.items()}, params, grads)
    interleaved(steppers, warmup, rounds, per_round)
    rows += _rows(f"bf16 step: {label}", steppers, "bf16, nearest", {})
    release()
    if profile.name in ("full", "quick"):
        draw(rows)
    return rows


def _short_label(config: str, variant: str) -> str:
    kind, _, what = config.partition(": ")
    if kind == "step":
        shapes = "transformer shapes" if "transformer" in what else what.replace(" leaves of ", " x ")
        return f"{variant} step, {shapes}"
    if kind == "init":
        return f"jitted init, {variant}"
    return f"bf16 step, {variant}"


def _goal(config: str, variant: str) -> float | None:
    kind = config.partition(":")[0]
    if kind == "step":
        return GOALS.get(variant)
    if kind == "init":
        return GOALS["init"]
    return GOALS.get(variant)


def draw(rows: Sequence[Row], path: Any = FIGURE) -> None:
    """Bars of each ratio against its baseline (the line at 1), with its goal marked on the bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(r.config, r.variant, r.extra["vs_baseline"]) for r in rows if r.extra.get("vs_baseline") is not None]
    groups = [g for g in groups if g[1] not in ("float32 state", "bf16, nearest")]
    fig, ax = plt.subplots(figsize=(6.8, 0.34 * len(groups) + 1.5), dpi=200)
    values = [v for _, _, v in groups]
    goals = [_goal(config, variant) for config, variant, _ in groups]
    ax.barh(range(len(groups)), values, color="#4477aa", height=0.7)
    for i, (value, goal) in enumerate(zip(values, goals, strict=True)):
        if goal is not None:
            ax.plot([goal, goal], [i - 0.42, i + 0.42], color="#cc3311", linewidth=2.2)
        x = value + 0.06
        for line in sorted(c for c in (1.0, goal) if c is not None):  # the label clears a line it would cross
            if value - 0.02 <= line <= x + 0.4:
                x = line + 0.06
        ax.text(x, i, f"{value:.2f}x", va="center", fontsize=9)
    ax.plot([], [], color="#cc3311", linewidth=2.2, label="goal")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(groups)), [_short_label(c, v) for c, v, _ in groups], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("time over the baseline measured in the same run", fontsize=9)
    ax.set_title("Step and init time: low-bit state over float32 state,\nparam rounding over bf16 round-to-nearest", fontsize=10)
    ax.set_xlim(0, max([*values, 3.0]) * 1.18)
    ax.legend(loc="lower right", fontsize=9, frameon=False)
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else "quick"
    profile = {"full": FULL, "quick": QUICK, "smoke": SMOKE}[name]
    for row in run(profile):
        print(f"{row.config:45s} {row.variant:16s} {row.value:9.2f} {row.unit}  x{row.extra['vs_baseline']:.2f}")
