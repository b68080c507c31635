"""Case 12: the memory ladder, what each rung of precision costs and saves when training a small model.

A decoder-only transformer (the one of case 11: pre-norm blocks of causal
attention and a GELU MLP, plain JAX, float32 arithmetic for every variant) is
trained character by character on the Python standard library's own source,
which ships with every Python: the files of :data:`STDLIB_MODULES`, read with
``inspect.getsourcefile``; the vocabulary is the bytes present in them. Each
file's last 10 % is held out. Every variant starts from the same float32
init (rounded to its param dtype), runs the same AdamW (warm-up and cosine
decay) and sees the same batches:

- ``float32 AdamW``: ``treeopt.Optimizer(tx)`` on float32 params, the
  baseline (the same numbers as raw optax);
- ``plain bf16``: bfloat16 params and nothing else, every new value rounded
  to the nearest bfloat16: the control, which shows what the other rungs keep
  from being rounded away;
- ``bf16 + f32 master``: bfloat16 params, ``master_dtype=jnp.float32``;
- ``bf16 + master + 8-bit`` and ``bf16 + master + 4-bit``: the same with
  ``state_bits=8`` or ``4`` (the moments as block-wise codes);
- ``float32 + 8-bit``: float32 params, ``state_bits=8``;
- :data:`ROUNDING_VARIANTS`, bfloat16 params without masters, stepped with
  ``param_rounding=``: measured automatically once ``treeopt.Optimizer``
  takes that argument.

Figures per variant:

- **bytes per param** of everything the optimizer holds (every array leaf of
  the trained ``treeopt.Optimizer``: masters, moments or their codes and
  scales, step counts) and of params plus optimizer, on one device;
- **bytes per param on device 0 under ZeRO-1**: params replicated over a
  ``data`` mesh of 8 virtual CPU devices, the optimizer made by
  ``treeopt.partitioning.init_sharded(..., shard_state_over="data")``, the
  arrays' addressable shards on device 0 summed: whatever the sharding of
  each leaf gives;
- **final loss**: the mean training loss over the last 10 % of steps (the
  same batches for every variant), and the loss on held-out windows after
  training; as ratios to float32 AdamW's;
- **step time**: the median of every step after the first
  :attr:`Config.timing_warmup`, as a ratio to float32 AdamW. The variants
  train in lockstep (one step of each in a shuffled order, then the next
  batch), so load from other processes hits them alike. One device; CPU-only
  and indicative.

Goals: 8-bit within 1 % and 4-bit within 3 % of float32's final loss; the
low-bit rungs' step time at most 1.1x float32's on CPU.

With the full and quick profiles, the case draws each variant's loss against
float32's and the bytes per param by part (:data:`FIGURES`, under
``docs/img/``; :mod:`benchmarks._ladder_figures`). Runs in a fresh process with
8 virtual CPU devices. Run alone:
``python -m benchmarks.memory_ladder [smoke|quick|full]``. Without training:
``python -m benchmarks.memory_ladder plot [RUN.json]`` draws both figures from
a run's record (``benchmarks/results/latest.json`` by default), and
``python -m benchmarks.memory_ladder bytes [quick|full]`` measures the bytes
of a fresh state at a profile's sizes (they do not change as it trains) and
draws the bytes figure, in seconds.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import _ladder_figures
from benchmarks._common import ROOT, Profile, Row, run_child
from benchmarks.mixed_precision import SMOKE_XLA_FLAGS, Model, transformer_loss, transformer_params

CASE = "memory_ladder"
DEVICES = 8
BASELINE = "float32 AdamW"
LOSS_GOALS = {8: 1.01, 4: 1.03}  # final loss over float32's, by state_bits
TIME_GOAL = 1.1  # step time over float32's, on CPU, for every low-bit rung
FIGURES = {
    "loss": ROOT / "docs/img/memory-ladder-loss.png",
    "bytes": ROOT / "docs/img/memory-ladder-bytes.png",
}
RESULTS = ROOT / "benchmarks" / "results"  # where benchmarks.run writes a run's record
SPEC_FIELDS = ("param_dtype", "master_dtype", "state_bits", "param_rounding")
# The corpus: standard-library modules whose source ships with every Python.
STDLIB_MODULES = (
    "textwrap",
    "argparse",
    "collections",
    "typing",
    "dataclasses",
    "functools",
    "enum",
    "inspect",
)

# variant: (param dtype, master_dtype, state_bits, param_rounding)
VARIANTS: dict[str, tuple[str, str | None, int | None, str | None]] = {
    BASELINE: ("float32", None, None, None),
    "plain bf16": ("bfloat16", None, None, None),  # the control: updates rounded to nearest
    "bf16 + f32 master": ("bfloat16", "float32", None, None),
    "bf16 + master + 8-bit": ("bfloat16", "float32", 8, None),
    "bf16 + master + 4-bit": ("bfloat16", "float32", 4, None),
    "float32 + 8-bit": ("float32", None, 8, None),
}
# bfloat16 params without masters, stepped with param_rounding=; the last is the smallest rung.
ROUNDING_VARIANTS: dict[str, tuple[str, str | None, int | None, str | None]] = {
    "bf16 + kahan": ("bfloat16", None, None, "kahan"),
    "bf16 + stochastic": ("bfloat16", None, None, "stochastic"),
    "bf16 + kahan + 8-bit": ("bfloat16", None, 8, "kahan"),
    "bf16 + stochastic + 4-bit": ("bfloat16", None, 4, "stochastic"),
}


def variants() -> dict[str, tuple[str, str | None, int | None, str | None]]:
    """Every variant, in the order of the tables: full precision first, then the rounding ones."""
    return {**VARIANTS, **ROUNDING_VARIANTS}


@dataclass(frozen=True)
class Config:
    """One profile's sizes: the model (its vocab comes from the text), the batches, the schedule."""

    d_model: int
    n_layers: int
    d_ff: int
    heads: int
    seq_len: int
    batch: int
    steps: int
    peak_lr: float
    timing_warmup: int  # steps left out of the step time (the first compiles)
    held_out_windows: int

    def model(self, vocab: int) -> Model:
        return Model(vocab, self.d_model, self.n_layers, self.d_ff, self.seq_len, self.batch, self.heads)


CONFIGS = {
    "full": Config(256, 4, 1024, 4, 64, 8, 200, 2e-3, 10, 128),
    "quick": Config(128, 2, 512, 4, 64, 16, 150, 3e-3, 5, 64),
    # smoke: no steps (a low-bit step takes XLA 10-20 s to compile on a busy 2-core CPU): the bytes of
    # a fresh state from its shapes and the shardings init_sharded would give it; the smallest leaves
    # that are still quantized (4,096 elements), with blocks of 128 or more.
    "smoke": Config(128, 1, 256, 2, 16, 2, 0, 1e-3, 0, 2),
}


def corpus() -> tuple[dict[str, int], Any, Any]:
    """``({file: characters}, train bytes, held-out bytes)``: each file's last 10 % held out."""
    import importlib
    import sysconfig

    import numpy as np

    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files, train, held = {}, [], []
    for name in STDLIB_MODULES:
        path = Path(inspect.getsourcefile(importlib.import_module(name)) or "").resolve()
        text = path.read_text(encoding="utf-8")
        files[path.relative_to(stdlib).as_posix()] = len(text)
        data = np.frombuffer(text.encode("utf-8"), np.uint8)
        cut = int(len(data) * 0.9)
        train.append(data[:cut])
        held.append(data[cut:])
    return files, np.concatenate(train), np.concatenate(held)


def windows(data: Any, starts: Any, length: int) -> Any:
    import numpy as np

    return data[np.asarray(starts)[..., None] + np.arange(length)]


def _child(profile_name: str, bytes_only: bool = False) -> dict[str, Any]:
    """Runs in the fresh 8-device process: bytes under ZeRO-1, then every variant trained in lockstep.

    ``bytes_only``: the profile's sizes, no step trained (the smoke profile's path).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import treeopt
    from treeopt._lowbit import is_quantized
    from treeopt.partitioning import init_sharded, optimizer_shardings

    config = CONFIGS[profile_name]
    if bytes_only:
        config = dataclasses.replace(config, steps=0, timing_warmup=0)
    abstract = config.steps == 0
    t0 = time.perf_counter()

    def log(message: str) -> None:  # progress, to stderr: the parent reads the figures from stdout
        print(f"[{CASE}] {time.perf_counter() - t0:6.1f} s  {message}", file=sys.stderr, flush=True)

    files, train_bytes, held_bytes = corpus()
    alphabet = np.unique(np.concatenate([train_bytes, held_bytes]))
    lookup = np.zeros(256, np.int32)
    lookup[alphabet] = np.arange(len(alphabet), dtype=np.int32)
    train_tokens, held_tokens = lookup[train_bytes], lookup[held_bytes]
    model = config.model(len(alphabet))
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(train_tokens) - model.seq_len, (config.steps, model.batch))
    batches = windows(train_tokens, starts, model.seq_len)
    held_starts = np.linspace(0, len(held_tokens) - model.seq_len, config.held_out_windows).astype(int)
    held_out = windows(held_tokens, held_starts, model.seq_len)
    params32 = transformer_params(model, seed=0)
    n_params = sum(int(x.size) for x in jax.tree.leaves(params32))
    loss_fn = transformer_loss(model, period=1)  # every next character counts
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.peak_lr, max(1, config.steps // 10), max(2, config.steps), end_value=config.peak_lr / 10
    )
    tx = optax.adamw(schedule, b2=0.99, weight_decay=0.01)
    ladder = variants()
    log(
        f"{n_params:,} params, vocab {model.vocab}, {sum(files.values()):,} characters, {len(ladder)} variants"
    )

    def optimizer(variant: str) -> Any:
        _, master_dtype, bits, rounding = ladder[variant]
        options: dict[str, Any] = {"master_dtype": master_dtype, "state_bits": bits}
        if rounding is not None:
            options["param_rounding"] = rounding
        return treeopt.Optimizer(tx, **options)

    def cast(variant: str) -> Any:
        dtype = jnp.dtype(ladder[variant][0])
        return jax.tree.map(lambda x: jnp.asarray(np.asarray(x).astype(dtype)), params32)

    def nbytes(tree: Any) -> int:  # arrays or their shapes (the smoke profile measures no arrays)
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))  # key dtypes too

    results: dict[str, dict[str, Any]] = {
        v: {
            "n_params": n_params,
            "spec": dict(zip(SPEC_FIELDS, ladder[v], strict=True)),
            "zero_devices": DEVICES,
        }
        for v in ladder
    }

    def parts(params: Any, opt: Any) -> dict[str, int]:
        """The bytes of each part of what a variant holds; ``other``: optimizer bytes none of them names."""
        state = jax.tree.leaves(opt.opt_state, is_leaf=is_quantized)
        state_counts = sum(
            nbytes(x) for x in state if not is_quantized(x) and jnp.issubdtype(x.dtype, jnp.integer)
        )
        rounding = getattr(opt, "rounding", None) or {}
        found = {
            "params": nbytes(params),
            "master": nbytes(opt.master),
            "compensation": nbytes(rounding.get("compensation", {})),
            "rounding_key": nbytes(rounding.get("key", {})),
            "moments": nbytes(opt.opt_state) - state_counts,  # or their codes and scales
            "counts": state_counts + nbytes(opt.step),
        }
        found["other"] = nbytes(opt) - sum(v for k, v in found.items() if k != "params")
        return found

    # 1. ZeRO-1: bytes on device 0 of params (replicated) and the optimizer, as init_sharded lays them out.
    mesh = Mesh(np.array(jax.devices()[:DEVICES]), ("data",))
    replicated = NamedSharding(mesh, P())
    device = jax.devices()[0]

    def device0_bytes(tree: Any, shardings: Any = None) -> int:
        if shardings is not None:  # shapes: the shard that device 0 would hold
            pairs = zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True)
            return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize for x, s in pairs)
        leaves = jax.tree.leaves(tree)
        return sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device)

    for variant in ladder:
        params = jax.device_put(cast(variant), replicated)
        specs = jax.tree.map(lambda _: P(), params)
        figures = results[variant]
        try:
            if abstract:  # the layout init_sharded would create, without compiling it
                shape = jax.eval_shape(optimizer(variant).init, params)
                shardings = optimizer_shardings(shape, specs, mesh, shard_state_over="data")
                opt_bytes = device0_bytes(shape, shardings)
            else:
                opt = init_sharded(optimizer(variant), params, mesh, specs, shard_state_over="data")
                opt_bytes = device0_bytes(opt)
                del opt
        except Exception as e:  # recorded, not hidden: the table shows what the sharding gave
            figures["zero_error"] = f"{type(e).__name__}: {e}"[:200]
            continue
        figures["zero_params_bytes_device0"] = device0_bytes(params)
        figures["zero_optimizer_bytes_device0"] = opt_bytes
        figures["zero_bytes_per_param_device0"] = (
            figures["zero_params_bytes_device0"] + opt_bytes
        ) / n_params
        del params
    log("ZeRO-1 bytes measured")

    # 2. Training, every variant in lockstep on device 0 (the smoke profile: the shapes of a fresh state).
    def step(params: Any, opt: Any, tokens: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        return opt.update(grads, params), opt, loss

    jitted = jax.jit(step, donate_argnums=(0, 1))
    states = {}
    for variant in ladder:
        params = jax.device_put(cast(variant), device)
        init = optimizer(variant).init
        # Jitted: eager, the codec would dispatch op by op.
        states[variant] = params, jax.eval_shape(init, params) if abstract else jax.jit(init)(params)
    losses: dict[str, list[float]] = {v: [] for v in ladder}
    times: dict[str, list[float]] = {v: [] for v in ladder}
    order = list(ladder)
    shuffle = random.Random(0)
    for i, batch in enumerate(batches):
        tokens = jax.device_put(batch, device)
        shuffle.shuffle(order)
        for variant in order:
            params, opt = states[variant]
            start = time.perf_counter()
            params, opt, loss = jitted(params, opt, tokens)
            loss = float(loss)  # waits for the step
            times[variant].append(time.perf_counter() - start)
            losses[variant].append(loss)
            states[variant] = params, opt
        if i == 0 or (i + 1) % max(1, config.steps // 10) == 0:
            log(f"step {i + 1}: " + ", ".join(f"{v} {losses[v][-1]:.3f}" for v in ladder))

    eval_loss = jax.jit(lambda params: loss_fn(params, jnp.asarray(held_out)))
    tail = max(1, config.steps // 10)
    for variant in ladder:
        params, opt = states[variant]
        quantized = [q for q in jax.tree.leaves(opt.opt_state, is_leaf=is_quantized) if is_quantized(q)]
        figures = results[variant]
        figures.update(
            params_bytes=nbytes(params),
            optimizer_bytes=nbytes(opt),
            master_bytes=nbytes(opt.master),
            lowbit_bytes=sum(nbytes(q) for q in quantized),
            lowbit_elements=sum(math.prod(q.shape) for q in quantized),
            parts_bytes=parts(params, opt),
        )
        figures["optimizer_bytes_per_param"] = figures["optimizer_bytes"] / n_params
        figures["bytes_per_param"] = (figures["params_bytes"] + figures["optimizer_bytes"]) / n_params
        if figures["lowbit_elements"]:
            # Per element of a quantized leaf: Adam holds two such leaves a param.
            figures["lowbit_bytes_per_element"] = figures["lowbit_bytes"] / figures["lowbit_elements"]
        if not abstract:
            figures.update(
                losses=losses[variant],
                final_loss=statistics.fmean(losses[variant][-tail:]),
                held_out_loss=float(eval_loss(jax.tree.map(lambda x: x.astype(jnp.float32), params))),
                median_ms=statistics.median(times[variant][config.timing_warmup :]) * 1e3,
            )
    log("trained and measured")
    return {
        "config": asdict(config),
        "model": asdict(model),
        "n_params": n_params,
        "corpus": {"files": files, "characters": sum(files.values()), "python": sys.version.split()[0]},
        "loss_measured_on": "nothing: the smoke profile trains no step"
        if abstract
        else f"training batches, mean of the last {tail} steps; held_out_loss: "
        f"{config.held_out_windows} windows spread evenly over the held-out text (each file's last 10 %)",
        "variants": results,
    }


def measure(profile_name: str, timeout_s: float = 3600, bytes_only: bool = False) -> dict[str, Any]:
    """The whole case in a fresh Python process with 8 virtual CPU devices; ``error`` if it failed.

    ``bytes_only``: the bytes of a fresh state at the profile's sizes, no step trained.
    """
    flags = SMOKE_XLA_FLAGS if profile_name == "smoke" or bytes_only else ()
    args = [profile_name, *(["bytes"] if bytes_only else [])]
    return run_child("benchmarks.memory_ladder", args, devices=DEVICES, xla_flags=flags, timeout_s=timeout_s)


def _goal(variant: str, loss_ratio: float | None, time_ratio: float | None) -> str | None:
    bits = variants()[variant][2]
    parts = []
    if bits in LOSS_GOALS and loss_ratio is not None:
        goal = LOSS_GOALS[bits]
        parts.append(f"loss <= {goal:.2f}x: {'met' if loss_ratio <= goal else 'missed'}")
    if bits is not None and time_ratio is not None:  # the low-bit rungs: their codec's cost
        parts.append(f"time <= {TIME_GOAL}x: {'met' if time_ratio <= TIME_GOAL else 'missed'}")
    return "; ".join(parts) or None


def run(
    profile: Profile,
    log: Callable[[str], None] = print,
    figures: bool | None = None,
    bytes_only: bool = False,
) -> list[Row]:
    """Rows of params + optimizer bytes per param; ``figures`` (default: not in smoke) draws the PNGs.

    ``bytes_only``: the bytes of a fresh state at the profile's sizes, no step trained
    (the bytes figure alone is drawn).
    """
    config = CONFIGS[profile.name]
    label = (
        f"adamw, transformer {config.n_layers} x {config.d_model}, {config.batch} x {config.seq_len} chars, "
        f"{config.steps} steps"
    )
    log(f"[{CASE}] {label}: {len(variants())} variants, ZeRO-1 bytes on {DEVICES} devices, own process")
    measured = measure(profile.name, bytes_only=bytes_only)
    if "variants" not in measured:
        return [Row(CASE, label, v, None, "B/param", extra={"error": measured["error"]}) for v in variants()]
    base = measured["variants"][BASELINE]
    shared = {k: measured[k] for k in ("corpus", "loss_measured_on", "model")}
    rows = []
    for variant, measures in measured["variants"].items():
        extra = dict(measures)
        if "final_loss" in measures:
            extra["loss_vs_float32"] = measures["final_loss"] / base["final_loss"]
            extra["held_out_vs_float32"] = measures["held_out_loss"] / base["held_out_loss"]
            extra["time_vs_float32"] = measures["median_ms"] / base["median_ms"]
            extra["goal"] = _goal(variant, extra["loss_vs_float32"], extra["time_vs_float32"])
        extra.update(shared)
        rows.append(Row(CASE, label, variant, measures["bytes_per_param"], "B/param", extra=extra))
    if figures if figures is not None else profile.name != "smoke":
        try:
            draw([row.as_dict() for row in rows], log)
        except Exception as e:  # the measured rows are worth more than their pictures
            log(f"[{CASE}] figures not drawn: {type(e).__name__}: {e}")
    return rows


def recorded(path: Path) -> list[dict[str, Any]]:
    """The case's rows in a run's JSON record (``python -m benchmarks.run`` writes them)."""
    record = json.loads(Path(path).read_text())
    try:
        return list(record["cases"][CASE]["rows"])
    except (KeyError, TypeError):
        raise ValueError(f"{path} holds no {CASE} case (cases: {sorted(record.get('cases', {}))})") from None


def ladder_table(rows: Sequence[Row | dict[str, Any]]) -> str:
    """The case's own markdown tables: the bytes, then (where steps were trained) the loss and time ratios.

    Two tables of four and five columns rather than one of eight: each fits the
    pages' content column at 1280 px, every column in view.
    """
    records = [row if isinstance(row, dict) else {"variant": row.variant, **row.extra} for row in rows]
    lines = [
        "| variant | optimizer B/param | params + optimizer B/param | ZeRO-1 B/param/device (8) |",
        "|---|---|---|---|",
    ]
    for r in records:
        if "bytes_per_param" not in r:
            lines.append(f"| {r['variant']} | {r.get('error', '-')} | | |")
            continue
        zero = r.get("zero_bytes_per_param_device0")
        zero_cell = f"{zero:.3f}" if zero is not None else r.get("zero_error", "-")
        lines.append(
            f"| {r['variant']} | {r['optimizer_bytes_per_param']:.3f} | {r['bytes_per_param']:.3f} | {zero_cell} |"
        )
    trained = [r for r in records if "final_loss" in r]
    if trained:
        lines += [
            "",
            "| variant | final loss | x float32 loss | held-out loss | x float32 step time |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['variant']} | {r['final_loss']:.4f} | {r['loss_vs_float32']:.4f} | {r['held_out_loss']:.4f} "
            f"| {r['time_vs_float32']:.3f} |"
            for r in trained
        ]
    return "\n".join(lines)


def draw(
    records: Sequence[dict[str, Any]], log: Callable[[str], None] = print, figures: dict[str, Path] = FIGURES
) -> list[Path]:
    """The PNGs of :data:`FIGURES` from the case's records (``Row.as_dict()`` or a run's JSON rows).

    The loss figure needs every variant's ``losses`` (a run that trained); the bytes
    figure draws from any record. Returns the paths written.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log(f"[{CASE}] no matplotlib (pip install -e '.[benchmarks]'): figures not drawn")
        return []
    written = []
    if all("losses" in r for r in records):
        _ladder_figures.save(_ladder_figures.loss_figure(records), figures["loss"])
        written.append(figures["loss"])
    else:
        log(f"[{CASE}] no losses in these records (no step trained): {figures['loss'].name} left as it is")
    _ladder_figures.save(_ladder_figures.bytes_figure(records), figures["bytes"])
    written.append(figures["bytes"])
    log(
        f"[{CASE}] figures: "
        + ", ".join(str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p) for p in written)
    )
    return written


def main(argv: Sequence[str]) -> None:
    if argv and argv[0] == "--child":
        print(json.dumps(_child(argv[1], bytes_only="bytes" in argv[2:])))
        return
    from benchmarks._common import FULL, QUICK, SMOKE

    def log(message: str) -> None:
        print(message, file=sys.stderr)

    profiles = {"full": FULL, "quick": QUICK, "smoke": SMOKE}
    if argv and argv[0] == "plot":  # a recorded run, drawn again: nothing measured
        records = recorded(Path(argv[1]) if len(argv) > 1 else RESULTS / "latest.json")
        draw(records, log=log)
        print(ladder_table(records))
        return
    if argv and argv[0] == "bytes":
        rows = run(profiles[argv[1] if len(argv) > 1 else "full"], log=log, figures=True, bytes_only=True)
        print(ladder_table(rows))
        return
    print(ladder_table(run(profiles[argv[0] if argv else "full"], log=log)))


if __name__ == "__main__":
    main(sys.argv[1:])
