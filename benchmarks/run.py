"""Runs the benchmark suite: every case side by side, a table of medians and ratios, a JSON record.

Usage::

    python -m benchmarks.run                 # everything (the figures in docs/benchmarks.md)
    python -m benchmarks.run --quick         # the headline ratios, a few minutes
    python -m benchmarks.run --smoke         # tiny sizes, seconds: checks that every case runs
    python -m benchmarks.run --cases train_step,memory --markdown

Results go to ``benchmarks/results/<UTC time>.json`` (and ``latest.json``);
``--out`` picks another folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: python benchmarks/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import (
    compile_time,
    eager,
    ema,
    gpu_bandwidth,
    gpu_lowbit,
    gpu_muon,
    lowbit_maps,
    lowbit_speed,
    many_leaves,
    memory,
    memory_ladder,
    mixed_precision,
    muon,
    nnx_loop,
    optimizer_only,
    retrace,
    train_step,
    zero,
)
from benchmarks._common import FULL, QUICK, SMOKE, Profile, Row, environment, with_ratios
from benchmarks._table import table

RESULTS = Path(__file__).resolve().parent / "results"

CASES: dict[str, tuple[str, Callable[..., list[Row]]]] = {
    "train_step": ("1. Jitted train step (median ms per step)", train_step.run),
    "optimizer_only": ("2. Optimizer-only step, tiny leaves (median ms per step)", optimizer_only.run),
    "eager_update": ("3. Eager update, no user jit (median ms per update)", eager.run),
    "compile_time": ("4. Trace + lower + compile of the train step (median s)", compile_time.run),
    "memory": ("5. Compiled step memory, donated (temp + output - alias, MiB)", memory.run),
    "retraces": ("6. Retraces after the first step, lr changed periodically", retrace.run),
    "gpu_bandwidth": ("7. GPU: adam/adamw update bandwidth (GB/s, 28 bytes/param)", gpu_bandwidth.run),
    "many_leaves": (
        "8. Many tiny leaves: first step, trace + compile + run (s), own process",
        many_leaves.run,
    ),
    "nnx_loop": ("9. nnx training loop, BatchNorm + Dropout (median ms per step)", nnx_loop.run),
    "zero": ("10. ZeRO-1: adam state per device, 8 virtual CPU devices (MiB), own process", zero.run),
    "mixed_precision": (
        "11. Mixed precision: bf16 + f32 masters, ZeRO-1, 8 virtual CPU devices (ms per step), own process",
        mixed_precision.run,
    ),
    "memory_ladder": (
        "12. Memory ladder: bf16, f32 masters, 8- and 4-bit state, char transformer (B/param), own process",
        memory_ladder.run,
    ),
    "gpu_lowbit": ("13. GPU: low-bit adam update bandwidth (GB/s of its lower bound)", gpu_lowbit.run),
    "lowbit_speed": (
        "14. Low-bit state speed: AdamW step, jitted init, stochastic rounding (x float32 state, same run)",
        lowbit_speed.run,
    ),
    "lowbit_maps": (
        "15. 4-bit signed map against the dynamic (torchao) map: first-moment error and final loss",
        lowbit_maps.run,
    ),
    "muon": (
        "16. Muon under data parallelism: one owner a matrix, 8 virtual CPU devices (ms per step), own process",
        muon.run,
    ),
    "gpu_muon": ("17. GPU: what one data-parallel device pays for Muon, owned or not (ms per step)", gpu_muon.run),
    "ema": (
        "18. EMA of params: step time with and without ema=, bytes per param, error of the average (own process)",
        ema.run,
    ),
}


def choose(quick: bool, smoke: bool, cases: str | None) -> tuple[Profile, list[str]]:
    """The profile and the cases to run: ``cases`` (comma-separated) or the profile's own."""
    profile = QUICK if quick else SMOKE if smoke else FULL
    selected = (
        list(profile.cases or CASES) if cases is None else [c.strip() for c in cases.split(",") if c.strip()]
    )
    unknown = [c for c in selected if c not in CASES]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    return profile, selected


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument(
        "--quick", action="store_true", help="the headline ratios (cases 1, 3, 5, 6 at 400 and 2,000 leaves)"
    )
    sizes.add_argument(
        "--smoke", action="store_true", help="tiny sizes and few steps: checks that every case runs"
    )
    parser.add_argument("--cases", default=None, help=f"comma-separated subset of: {', '.join(CASES)}")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON record")
    parser.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    parser.add_argument("--no-nnx", action="store_true", help="leave out the flax.nnx variants")
    parser.add_argument("--silent", action="store_true", help="no progress lines, only the tables")
    args = parser.parse_args(argv)
    try:
        profile, selected = choose(args.quick, args.smoke, args.cases)
    except ValueError as e:
        parser.error(str(e))
    if args.no_nnx:
        profile = dataclasses.replace(profile, nnx=False)

    def log(message: str) -> None:
        if not args.silent:
            print(message, file=sys.stderr, flush=True)

    env = environment()
    log(
        f"treeopt benchmarks ({profile.name}): jax {env['jax']}, optax {env['optax']}, flax {env['flax']}, "
        f"{env['backend']} ({env['device']}), {env['cpu_count']} CPUs"
    )
    started = time.perf_counter()
    results: dict[str, Any] = {"environment": env, "profile": profile.name, "cases": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{profile.name}.json"

    def save() -> None:  # after every case, so a long run that stops early keeps what it measured
        text = json.dumps(results, indent=1, default=str)
        path.write_text(text)
        (args.out / "latest.json").write_text(text)

    for name in selected:
        title, fn = CASES[name]
        t0 = time.perf_counter()
        rows = with_ratios(fn(profile, log=log))
        results["cases"][name] = {
            "title": title,
            "seconds": time.perf_counter() - t0,
            "rows": [r.as_dict() for r in rows],
        }
        save()
        print(f"\n{'## ' if args.markdown else ''}{title}\n\n{table(rows, args.markdown)}", flush=True)
    results["seconds"] = time.perf_counter() - started
    results["environment"]["load_average_end"] = environment()["load_average"]
    save()
    log(f"\n{len(selected)} case(s) in {results['seconds']:.0f} s; results written to {path}")
    results["path"] = str(path)
    return results


if __name__ == "__main__":
    main()
