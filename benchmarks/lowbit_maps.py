"""Case 15: treeopt's 4-bit signed map against the dynamic-exponent map of torchao and Li et al., on real moments.

The character-level transformer of case 12 is trained with float32 AdamW; at
a few steps its first moments are cut in blocks of 128 and divided by each
block's maximum, as both codecs do, and each map's error is measured:
``||quantized - m|| / ||m||`` per leaf, averaged over the leaves. Then the same
model is trained with 4-bit state under each map (and at float32), on the
same batches, and the final losses are compared.

The dynamic map is built from its description: the decades below 1 cut in 1,
2 and 4 equal steps whose midpoints are the levels, both signs, plus 0 and
1 (no -1). Training with it swaps treeopt's 4-bit signed map for a table of
those levels (a lookup: slower, which this case does not time).
Run alone: ``python -m benchmarks.lowbit_maps [smoke|quick|full]``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

import treeopt
from benchmarks._common import FULL, QUICK, SMOKE, Profile, Row
from benchmarks.memory_ladder import CONFIGS, corpus, windows
from benchmarks.mixed_precision import transformer_loss, transformer_params
from treeopt._lowbit import levels as lowbit_levels
from treeopt._lowbit import looked_up

CASE = "lowbit_maps"
BLOCK = 128
STEPS = {"full": (300, (20, 100, 300)), "quick": (150, (20, 150)), "smoke": (2, (2,))}


def dynamic_levels() -> np.ndarray:
    """The 4-bit signed dynamic-exponent map: 3 decades in 1, 2 and 4 steps (their midpoints), and 0 and 1."""
    levels = [0.0, 1.0]
    for i in range(3):
        edges = np.linspace(0.1, 1.0, 2**i + 1)
        for mid in (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 2):
            levels += [float(mid), -float(mid)]
    return np.sort(np.asarray(levels, np.float32))


def relative_error(moment: np.ndarray, levels: np.ndarray) -> float:
    """``||q(m) - m|| / ||m||`` with blocks of :data:`BLOCK` along the flattened moment, nearest levels."""
    flat = moment.reshape(-1)
    flat = np.pad(flat, (0, -len(flat) % BLOCK)).reshape(-1, BLOCK)
    scale = np.abs(flat).max(axis=1, keepdims=True)
    y = flat / np.where(scale > 0, scale, 1)
    mids = (levels[1:] + levels[:-1]) / 2
    q = levels[np.searchsorted(mids, y)] * scale
    return float(np.linalg.norm(q - flat) / max(np.linalg.norm(flat), 1e-30))


def run(profile: Profile, log: Callable[[str], None] = print) -> list[Row]:
    name = profile.name if profile.name in STEPS else "full"
    steps, probes = STEPS[name]
    config = CONFIGS["quick" if name != "smoke" else "smoke"]
    _, train_bytes, held_bytes = corpus()
    alphabet = np.unique(np.concatenate([train_bytes, held_bytes]))
    lookup = np.zeros(256, np.int32)
    lookup[alphabet] = np.arange(len(alphabet), dtype=np.int32)
    tokens = lookup[train_bytes]
    model = config.model(len(alphabet))
    rng = np.random.default_rng(1)  # other batches than case 12's
    batches = windows(tokens, rng.integers(0, len(tokens) - model.seq_len, (steps, model.batch)), model.seq_len)
    loss_fn = transformer_loss(model, period=1)
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, max(1, steps // 10), max(2, steps)), b2=0.99)

    def train(state_bits: int | None, collect: bool = False) -> tuple[float, dict[int, list[np.ndarray]]]:
        params = transformer_params(model, seed=1)
        opt = treeopt.Optimizer(tx, state_bits=state_bits).init(params)

        @jax.jit
        def step(params: Any, opt: Any, batch: Any) -> Any:
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            return opt.update(grads, params), opt, loss

        losses, moments = [], {}
        for i in range(steps):
            params, opt, loss = step(params, opt, batches[i])
            losses.append(float(loss))
            if collect and i + 1 in probes:
                mu = opt.opt_state[0].mu
                moments[i + 1] = [np.asarray(x) for x in mu.values() if x.size >= 4096]
        tail = max(1, steps // 10)
        return float(np.mean(losses[-tail:])), moments

    log(f"[{CASE}] float32 AdamW, {steps} steps, first moments at steps {probes}")
    full_loss, moments = train(None, collect=True)
    ours, dynamic = np.asarray(lowbit_levels(4, True)), dynamic_levels()
    rows = []
    for step, leaves in moments.items():
        for label, levels in (("treeopt 4-bit signed", ours), ("dynamic (torchao)", dynamic)):
            error = float(np.mean([relative_error(m, levels) for m in leaves]))
            rows.append(Row(CASE, f"first-moment error, step {step}", label, error, "rel. L2"))
    log(f"[{CASE}] 4-bit training under each map")
    loss_ours, _ = train(4)
    with looked_up(dynamic, bits=4, signed=True):
        loss_dynamic, _ = train(4)
    for label, loss in (("float32 state", full_loss), ("treeopt 4-bit signed", loss_ours), ("dynamic (torchao)", loss_dynamic)):
        rows.append(Row(CASE, f"final loss, {steps} steps", label, loss, "loss", extra={"vs_float32": loss / full_loss}))
    return rows


if __name__ == "__main__":
    profile = {"full": FULL, "quick": QUICK, "smoke": SMOKE}[sys.argv[1] if len(sys.argv) > 1 else "quick"]
    for row in run(profile):
        print(f"{row.config:36s} {row.variant:22s} {row.value:.4f} {row.extra.get('vs_float32', '')}")
