"""Case 18: ``ema=``, an average of the params: what it costs a step, what it holds, how exact it is.

bfloat16 params trained with AdamW on float32 master weights, the decoder-only
transformer of case 11 (:mod:`benchmarks.mixed_precision`) on one device.
Three measurements, in one run:

- **step time**: the jitted, donated train step (forward, backward, update),
  variants interleaved as in the other cases, in two passes that build
  them in opposite orders, each one's samples pooled (case 1 does so for
  optax and treeopt):

  - ``optax``: raw optax on bfloat16 params with float32 masters kept by hand
    (adamw steps the masters, the params are their bfloat16 rounding; the
    baseline);
  - ``treeopt``: ``treeopt.Optimizer(tx, master_dtype=jnp.float32)``;
  - ``treeopt, ema=0.999``: the same with ``ema=0.999``;
  - ``treeopt + bf16 average by hand``: ``treeopt`` and, after the update,
    ``nnx.EMA``'s rule ``decay * avg + (1 - decay) * params`` on the
    bfloat16 params, kept in bfloat16 (what ``nnx.EMA`` keeps for them);

- **bytes of the average per param**, on 8 virtual CPU devices (a child
  process): device 0's shards of ``opt.ema_state`` over the param count, the
  state replicated and split by ZeRO-1 (``shard_state_over="data"``), beside
  the masters' bytes, which it is split like;
- **the error of the average**: a smaller transformer trained from its
  bfloat16 init for a few hundred AdamW steps; after each step the reference
  ``ref = d * ref + (1 - d) * master`` is computed in float64 from
  ``opt.master``, and each average's relative L2 error over all params,
  ``||avg - ref|| / ||ref||``, is recorded: treeopt's ``opt.ema`` and a
  bfloat16 average of the bfloat16 params by ``nnx.EMA``'s rule. The full
  and quick profiles draw both over the steps (:data:`FIGURE`).

The step times and the errors are measured in a fresh one-device process,
the bytes in one with ``--xla_force_host_platform_device_count=8``. Run
alone: ``python -m benchmarks.ema [smoke|quick|full]``.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from benchmarks._common import ROOT, Profile, Row, run_child
from benchmarks.mixed_precision import (
    SMOKE_XLA_FLAGS,
    Model,
    motif_batches,
    transformer_loss,
    transformer_params,
)

CASE = "ema"
DECAY = 0.999
DEVICES = 8
BASELINE = "optax"
FIGURE = ROOT / "docs/img/ema-error.png"
WITH_EMA = f"treeopt, ema={DECAY:g}"
VARIANTS = (BASELINE, "treeopt", WITH_EMA, "treeopt + bf16 average by hand")
LAYOUTS = {"replicated": None, "ZeRO-1 over data": "data"}
AVERAGES = {
    "treeopt": "treeopt ema= (float32, from the masters)",
    "bf16": "bf16 average of the bf16 params (nnx.EMA's rule)",
}


@dataclass(frozen=True)
class Config:
    """One profile's sizes: the timed model and its timing, and the run the error is measured on."""

    timed: Model
    warmup: int
    rounds: int
    per_round: int
    lr: float
    trained: Model
    period: int  # the repeated motif's length (the task of case 11)
    steps: int
    second_pass: bool = True


CONFIGS = {
    "full": Config(
        timed=Model(vocab=1024, d_model=256, n_layers=4, d_ff=1024, seq_len=64, batch=2),
        warmup=2,
        rounds=15,
        per_round=5,
        lr=1e-3,
        trained=Model(vocab=32, d_model=64, n_layers=2, d_ff=256, seq_len=32, batch=16),
        period=8,
        steps=600,
    ),
    "quick": Config(
        timed=Model(vocab=256, d_model=128, n_layers=2, d_ff=512, seq_len=64, batch=2),
        warmup=2,
        rounds=10,
        per_round=5,
        lr=1e-3,
        trained=Model(vocab=32, d_model=64, n_layers=2, d_ff=256, seq_len=32, batch=16),
        period=8,
        steps=300,
    ),
    "smoke": Config(
        timed=Model(vocab=16, d_model=16, n_layers=1, d_ff=32, seq_len=8, batch=2, heads=2),
        warmup=1,
        rounds=1,
        per_round=2,
        lr=1e-3,
        trained=Model(vocab=16, d_model=16, n_layers=1, d_ff=32, seq_len=8, batch=2, heads=2),
        period=4,
        steps=5,
        second_pass=False,
    ),
}


def _tx(lr: float) -> Any:
    import optax

    return optax.adamw(lr, weight_decay=0.01)


def _bf16(params32: Any) -> Any:
    """Fresh bfloat16 device arrays of host float32 params (buffers a donated step may take)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x).astype(jnp.bfloat16)), params32)


def nnx_ema_rule(average: Any, params: Any, decay: float = DECAY) -> Any:
    """``nnx.EMA.update``'s rule on plain arrays: ``decay * avg + (1 - decay) * params``, in their dtype."""
    import jax

    return jax.tree.map(lambda a, p: decay * a + (1.0 - decay) * p, average, params)


@functools.lru_cache(maxsize=4)
def _programs(
    model: Model, period: int, lr: float
) -> dict[str, tuple[Callable[[Any], Any], Callable[..., Any]]]:
    """``{variant: (init, step)}``: ``init(params32)`` the state, ``step(state, tokens) -> (state, loss)``.

    ``step`` is jitted, the state donated; built once per model, so a run whose
    two models are the same size compiles each step once.
    """
    import jax
    import jax.numpy as jnp
    import optax

    import treeopt

    loss_fn = transformer_loss(model, period)
    tx = _tx(lr)

    def raw_init(params32: Any) -> Any:
        params = _bf16(params32)
        masters = jax.tree.map(lambda p: p.astype(jnp.float32), params)  # from the params, as treeopt's
        return params, masters, tx.init(masters)

    def raw_step(state: Any, tokens: Any) -> Any:
        params, masters, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, opt_state = tx.update(grads, opt_state, masters)
        masters = optax.apply_updates(masters, updates)
        return (jax.tree.map(lambda m: m.astype(jnp.bfloat16), masters), masters, opt_state), loss

    def treeopt_program(ema: float | None, by_hand: bool) -> tuple[Callable[[Any], Any], Callable[..., Any]]:
        base = treeopt.Optimizer(tx, master_dtype=jnp.float32, ema=ema)

        def init(params32: Any) -> Any:
            params = _bf16(params32)
            opt = base.init(params)
            return (params, opt, _bf16(params32)) if by_hand else (params, opt)

        def step(state: Any, tokens: Any) -> Any:
            params, opt, *average = state
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
            params = opt.update(grads, params)
            if by_hand:
                return (params, opt, nnx_ema_rule(average[0], params)), loss
            return (params, opt), loss

        return init, step

    built = {
        BASELINE: (raw_init, raw_step),
        "treeopt": treeopt_program(None, False),
        WITH_EMA: treeopt_program(DECAY, False),
        "treeopt + bf16 average by hand": treeopt_program(None, True),
    }
    return {name: (init, jax.jit(step, donate_argnums=(0,))) for name, (init, step) in built.items()}


def step_times(config: Config, log: Callable[[str], None]) -> dict[str, Any]:
    """Every variant's train step, compiled, then timed side by side: ``{variant: figures}``.

    On this CPU a program compiled earlier in a process runs a few percent
    faster than one compiled later, so every variant is timed in a second pass
    that builds them in the opposite order (the compile cache cleared
    between), and its samples pooled, as case 1 pools optax's and treeopt's.
    """
    import jax

    from benchmarks._common import Stepper, median_ms, release, spread, timed_pass

    params32 = transformer_params(config.timed)
    n_params = sum(int(x.size) for x in jax.tree.leaves(params32))
    tokens = jax.numpy.asarray(motif_batches(config.timed, config.period, 1, seed=1)[0])
    programs = _programs(config.timed, config.period, config.lr)

    def build(name: str) -> tuple[Stepper, None]:
        init, step = programs[name]
        cell = [init(params32)]

        def one() -> Any:
            cell[0], loss = step(cell[0], tokens)
            return loss

        return Stepper(name, one), None

    figures: dict[str, dict[str, Any]] = {}
    passes = [VARIANTS, VARIANTS[::-1]] if config.second_pass else [VARIANTS]
    for i, names in enumerate(passes):
        if i:
            release()  # the second pass compiles again, in its own order
        steppers, _ = timed_pass(names, build, config.warmup, config.rounds, config.per_round)
        log(f"pass {i + 1} timed: {', '.join(names)}")
        for s in steppers:
            found = figures.setdefault(s.name, {"times": [], "first_call_s": []})
            found["times"] += s.times
            found["first_call_s"].append(s.first_call_s)
            found[f"median_ms_pass{i + 1}"] = median_ms(s.times)
        del steppers
    for found in figures.values():
        times = found.pop("times")
        found.update(median_ms=median_ms(times), n_params=n_params, **spread(times))
    return figures


def average_errors(config: Config, log: Callable[[str], None]) -> dict[str, Any]:
    """Each average's relative L2 error against the float64 average of the masters, after every step.

    The steps are those of the variant ``treeopt, ema=`` (the same program where
    the models are the same size); the bfloat16 average follows each step by
    :func:`nnx_ema_rule`, on the bfloat16 params.
    """
    import jax
    import numpy as np

    model = config.trained
    init, step = _programs(model, config.period, config.lr)[WITH_EMA]
    params, opt = init(transformer_params(model, seed=2))
    narrow = _bf16(transformer_params(model, seed=2))  # the bf16 average starts from the params, as nnx.EMA's
    average = jax.jit(nnx_ema_rule)
    names = list(opt.master)
    reference = {name: np.asarray(x, np.float64) for name, x in opt.layout.split_params(params)[0].items()}
    start = dict(reference)
    d = np.float64(DECAY)
    errors: dict[str, list[float]] = {key: [] for key in AVERAGES}
    for tokens in motif_batches(model, config.period, config.steps, seed=5):
        (params, opt), _ = step((params, opt), tokens)
        narrow = average(narrow, params)
        masters = jax.device_get(opt.master)
        for name in names:
            reference[name] = d * reference[name] + (1 - d) * np.asarray(masters[name], np.float64)
        norm = np.sqrt(sum(np.sum(r**2) for r in reference.values()))
        found = {
            "treeopt": jax.device_get(opt.ema),
            "bf16": jax.device_get(opt.layout.split_params(narrow)[0]),
        }
        for key, averages in found.items():
            diff = sum(np.sum((np.asarray(averages[n], np.float64) - reference[n]) ** 2) for n in names)
            errors[key].append(float(np.sqrt(diff) / norm))
    log(f"{config.steps} steps averaged")
    n_params = sum(int(r.size) for r in reference.values())
    moved = {  # the fraction of elements each average moved from where it started
        key: sum(int(np.sum(np.asarray(averages[n], np.float64) != start[n])) for n in names) / n_params
        for key, averages in found.items()
    }
    return {"errors": errors, "moved": moved, "n_params": n_params}


def device0_bytes(config: Config) -> dict[str, Any]:
    """On 8 devices: the average's bytes on device 0, replicated and under ZeRO-1, beside the masters'."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import treeopt
    from treeopt.partitioning import init_sharded, zero_report

    assert jax.device_count() >= DEVICES, jax.devices()
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("data",))
    device = jax.devices()[0]
    params32 = transformer_params(config.timed)
    specs = jax.tree.map(lambda _: P(), params32)
    params = jax.device_put(_bf16(params32), NamedSharding(mesh, P()))
    n_params = sum(int(x.size) for x in jax.tree.leaves(params))

    def on_device0(tree: Any) -> int:
        return sum(
            s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == device
        )

    out: dict[str, Any] = {}
    for layout, over in LAYOUTS.items():
        base = treeopt.Optimizer(_tx(config.lr), master_dtype=jnp.float32, ema=DECAY)
        opt = init_sharded(base, params, mesh, specs, shard_state_over=over)
        figures = {
            "n_params": n_params,
            "ema_bytes_device0": on_device0(opt.ema_state),
            "master_bytes_device0": on_device0(opt.master),
            "ema_leaves": len(opt.ema_state),
        }
        if over is not None:
            report = zero_report(opt, specs, mesh, over)
            figures["ema_leaves_split"] = sum(leaf.path.startswith("ema") for leaf in report.sharded)
        out[layout] = figures
    return out


def _child(kind: str, profile_name: str) -> dict[str, Any]:
    """Runs in a fresh process: ``steps`` (step times and errors, one device) or ``bytes`` (8 devices)."""
    config = CONFIGS[profile_name]
    t0 = time.perf_counter()

    def log(message: str) -> None:  # progress, to stderr: the parent reads the figures from stdout
        print(f"[{CASE}] {time.perf_counter() - t0:6.1f} s  {message}", file=sys.stderr, flush=True)

    if kind == "bytes":
        return device0_bytes(config)
    return {"steps": step_times(config, log), **average_errors(config, log)}


def measure(kind: str, profile_name: str, timeout_s: float = 1200) -> dict[str, Any]:
    """:func:`_child` in a fresh Python process (``bytes``: with 8 virtual CPU devices); ``error`` if it failed."""
    flags = SMOKE_XLA_FLAGS if profile_name == "smoke" else ()
    devices = DEVICES if kind == "bytes" else 1
    return run_child(
        "benchmarks.ema", [kind, profile_name], devices=devices, xla_flags=flags, timeout_s=timeout_s
    )


def run(profile: Profile, log: Callable[[str], None] = print) -> list[Row]:
    name = profile.name if profile.name in CONFIGS else "full"
    config = CONFIGS[name]
    log(
        f"[{CASE}] step time of {len(VARIANTS)} variants, transformer {config.timed.label()}; "
        f"error of the averages over {config.steps} steps, transformer {config.trained.label()}; "
        f"bytes of the average on {DEVICES} virtual CPU devices; own processes"
    )
    if name == "smoke":  # nothing is timed: the two processes side by side
        with ThreadPoolExecutor(2) as pool:
            measured_bytes, measured = pool.map(lambda kind: measure(kind, name), ("bytes", "steps"))
    else:  # the 8-device process first, not beside the timed steps
        measured_bytes = measure("bytes", name)
        measured = measure("steps", name)
    failed = {"error": measured.get("error", "no figures")}

    rows = []
    steps = measured.get("steps", {})
    n_params = next(iter(steps.values()), {}).get("n_params", 0)
    label = (
        f"adamw {config.lr:g}, bf16 params + f32 masters, transformer {config.timed.label()} "
        f"({n_params / 1e6:.1f}M params)"
    )
    for variant in VARIANTS:
        figures = dict(steps.get(variant, failed))
        value = figures.get("median_ms")
        treeopt_ = steps.get("treeopt", {})
        if value is not None and treeopt_.get("median_ms") and variant not in (BASELINE, "treeopt"):
            figures["vs_treeopt"] = value / treeopt_["median_ms"]  # all samples pooled
            for key in ("median_ms_pass1", "median_ms_pass2"):  # each pass alone, where both ran in it
                if key in figures and key in treeopt_:
                    figures[f"vs_treeopt_{key[-5:]}"] = figures[key] / treeopt_[key]
        rows.append(Row(CASE, label, variant, value, "ms", extra=figures))

    bytes_label = f"average, bytes per param on device 0 of {DEVICES} (the transformer above)"
    for layout in LAYOUTS:
        figures = dict(measured_bytes.get(layout, {"error": measured_bytes.get("error", "no figures")}))
        value = None
        if "ema_bytes_device0" in figures:
            n = figures["n_params"]
            value = figures["ema_bytes_device0"] / n
            figures["mib_device0"] = figures["ema_bytes_device0"] / 2**20
            figures["master_bytes_per_param"] = figures["master_bytes_device0"] / n
        rows.append(Row(CASE, bytes_label, layout, value, "B/param", extra=figures))

    errors = measured.get("errors")
    n_trained = measured.get("n_params", 0)
    error_label = (
        f"relative L2 error against a float64 average of the masters after {config.steps} steps, "
        f"decay {DECAY:g}, adamw {config.lr:g}, transformer {config.trained.label()} "
        f"({n_trained / 1e3:.0f}k params)"
    )
    for key, variant in AVERAGES.items():
        if errors is None:
            rows.append(Row(CASE, error_label, variant, None, "rel. L2", extra=failed))
            continue
        curve = errors[key]
        at = {f"error_step_{s}": curve[s - 1] for s in (1, 10, 100) if s <= len(curve)}
        extra = {**at, "moved": measured["moved"][key], "errors": curve, "n_params": n_trained}
        rows.append(Row(CASE, error_label, variant, curve[-1], "rel. L2", extra=extra))
    if errors is not None and profile.name in ("full", "quick"):
        draw(errors, config)
    return rows


def draw(errors: dict[str, Sequence[float]], config: Config, path: Any = FIGURE) -> None:
    """Both averages' relative errors over the steps, on a log scale."""
    import numpy as np

    from benchmarks._ladder_figures import FONT_PT, _figure, save

    fig, ax = _figure(4.0)
    styles = {"treeopt": {"color": "#1f77b4", "linewidth": 1.8}, "bf16": {"color": "black", "linewidth": 1.8}}
    for key, label in AVERAGES.items():
        curve = np.asarray(errors[key], float)
        steps = np.arange(1, len(curve) + 1)
        shown = curve > 0  # a log scale has no place for an exact average
        ax.plot(steps[shown], curve[shown], label=label, **styles[key])
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=FONT_PT)
    ax.set_xlabel("step", fontsize=FONT_PT)
    ax.set_ylabel("||average - float64 average||\n/ ||float64 average||", fontsize=FONT_PT)
    ax.set_title(
        f"Error of the average (decay {DECAY:g}) against a float64 average of the masters\n"
        f"bf16 params, f32 masters, AdamW {config.lr:g}, transformer {config.trained.n_layers} x "
        f"{config.trained.d_model}",
        fontsize=FONT_PT + 0.5,
    )
    fig.legend(loc="outside lower center", ncol=1, fontsize=FONT_PT, frameon=False)
    save(fig, path)


def main(argv: Sequence[str]) -> None:
    if argv and argv[0] == "--child":
        print(json.dumps(_child(argv[1], argv[2])))
        return
    from benchmarks._common import FULL, QUICK, SMOKE, with_ratios
    from benchmarks._table import table

    profile = {"full": FULL, "quick": QUICK, "smoke": SMOKE}[argv[0] if argv else "full"]
    t0 = time.perf_counter()
    print(table(with_ratios(run(profile, log=lambda m: print(m, file=sys.stderr)))))
    print(f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
