"""The memory ladder's two figures (case 12), drawn from its records: one dict per variant.

A record is a row of a run's JSON (``benchmarks/results/*.json``, under
``cases.memory_ladder.rows``) or of :func:`benchmarks.memory_ladder.run`. The
figures read, per variant: ``variant``, ``config``, ``spec`` (param dtype,
``master_dtype``, ``state_bits``, ``param_rounding``), ``n_params``,
``parts_bytes`` (the bytes of each part of what is held, see :data:`PARTS`),
``zero_bytes_per_param_device0`` and, for the loss figure, ``losses`` (one per
step, the same batches for every variant). Nothing here names a variant: the
styles follow each one's spec, so a new rung of the ladder is drawn as it is
measured.

Both figures are drawn for the pages' content column: :data:`WIDTH_PX` wide
as shown (``{ width="680" }`` on the pages), stored at twice that for sharp
screens, with no text under :data:`MIN_TEXT_PX` as shown.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

BASELINE = "float32 AdamW"
WIDTH_PX = 680  # as shown: Material's content column is 688 px wide in a 1280 px window
SCALE = 2  # pixels stored per pixel shown
DPI = 100  # points become pixels at DPI / 72 as shown
MIN_TEXT_PX = 12.0
FONT_PT = 9.5  # the smallest text drawn: 13.2 px as shown
# What a variant holds, in the order the bars stack: (key of ``parts_bytes``, label, colour).
PARTS = (
    ("params", "params", "#4c72b0"),
    ("master", "float32 master copy", "#dd8452"),
    ("compensation", "Kahan compensation buffer", "#8172b3"),
    ("rounding_key", "stochastic-rounding key", "#c44e52"),
    ("moments", "moments: float, or 8-/4-bit codes + scales", "#55a868"),
    ("counts", "step counts", "#937860"),
    ("other", "other optimizer state", "#da8bc3"),
)
ZERO_COLOUR = "0.72"
LINE_COLOURS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
)


def spec(record: Mapping[str, Any]) -> dict[str, Any]:
    """``{"param_dtype", "master_dtype", "state_bits", "param_rounding"}`` of a record's variant."""
    found = record.get("spec")
    if found is None:
        raise ValueError(
            f"the record of {record.get('variant')!r} has no 'spec': it comes from a run before the "
            "figures read one; re-run the case (python -m benchmarks.memory_ladder)"
        )
    return dict(found)


def is_control(record: Mapping[str, Any]) -> bool:
    """Narrow params stepped with nothing to keep small updates: no master copy, plain rounding."""
    s = spec(record)
    return s["param_dtype"] != "float32" and s["master_dtype"] is None and s["param_rounding"] is None


def line_style(record: Mapping[str, Any], index: int) -> dict[str, Any]:
    """How a variant's curve is drawn: colour by position, dashes by how the params are kept, marks by bits."""
    s = spec(record)
    if is_control(record):
        return {"color": "black", "linestyle": "-", "linewidth": 2.4}
    if s["param_rounding"] == "kahan":
        dashes = "--"
    elif s["param_rounding"] == "stochastic":
        dashes = "-."
    elif s["param_dtype"] == "float32":
        dashes = ":"
    else:
        dashes = "-"
    marker = {8: "o", 4: "s"}.get(s["state_bits"], "")
    colour = LINE_COLOURS[index % len(LINE_COLOURS)]
    return {"color": colour, "linestyle": dashes, "linewidth": 1.7, "marker": marker, "markersize": 4.5}


def smoothing_window(steps: int) -> int:
    return max(1, steps // 20)


def running_mean(values: Sequence[float], width: int) -> Any:
    import numpy as np

    values = np.asarray(values, float)
    return np.convolve(values, np.ones(width) / width, mode="valid")


def _figure(height_in: float, rows: int = 1, **grid: Any) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(
        rows, 1, figsize=(WIDTH_PX / DPI, height_in), dpi=DPI * SCALE, layout="constrained", **grid
    )


def loss_figure(records: Sequence[Mapping[str, Any]]) -> Any:
    """Each variant's training loss minus float32 AdamW's, step by step, as a running mean.

    The variants see the same batches, so the difference cancels the batch-to-batch
    noise that hides them when the losses are drawn themselves. Where the control
    (narrow params without a remedy) strays far beyond the others, a second panel
    shows the others at their own scale.
    """
    import numpy as np

    by_name = {r["variant"]: r for r in records}
    if BASELINE not in by_name or "losses" not in by_name[BASELINE]:
        raise ValueError(f"the loss figure needs the {BASELINE!r} record with its losses")
    base = np.asarray(by_name[BASELINE]["losses"], float)
    width = smoothing_window(len(base))
    curves = []
    for index, record in enumerate(r for r in records if r["variant"] != BASELINE):
        if "losses" not in record:
            raise ValueError(
                f"the record of {record['variant']!r} has no losses (a run that trained no step)"
            )
        diff = running_mean(np.asarray(record["losses"], float) - base, width)
        curves.append((record, diff, line_style(record, index)))
    steps = np.arange(len(base) - width + 1) + width  # the last step each mean covers

    def peak(diffs: Sequence[Any]) -> float:
        return max((float(np.max(np.abs(d))) for d in diffs), default=0.0)

    methods = [c for c in curves if not is_control(c[0])]
    controls = [c for c in curves if is_control(c[0])]
    zoom = (
        bool(controls)
        and bool(methods)
        and peak([c[1] for c in controls]) > 3 * peak([c[1] for c in methods])
    )
    if zoom:
        fig, (top, bottom) = _figure(6.6, 2, sharex=True, gridspec_kw={"height_ratios": [1, 1.6]})
        panels = [(top, curves), (bottom, methods)]
    else:
        fig, ax = _figure(5.0)
        panels = [(ax, curves)]
    every = max(1, len(steps) // 12)
    for ax, drawn in panels:
        ax.axhline(0.0, color="0.35", linewidth=1.0)
        for record, diff, style in drawn:
            ax.plot(steps, diff, label=record["variant"], markevery=every, **style)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=FONT_PT)
        ax.set_ylabel("loss \u2212 float32's\n(nats per character)", fontsize=FONT_PT)
    first, last = panels[0][0], panels[-1][0]
    if zoom:
        first.set_title("all variants", fontsize=FONT_PT, loc="left")
        last.set_title("without the control, at their own scale", fontsize=FONT_PT, loc="left")
    last.set_xlabel(f"step (running mean over {width} steps)", fontsize=FONT_PT)
    fig.suptitle(
        f"Each variant's training loss minus {BASELINE}'s (the line at 0)\n{records[0]['config']}",
        fontsize=FONT_PT + 0.5,
    )
    handles, labels = first.get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="outside lower center", ncol=2, fontsize=FONT_PT, frameon=False, handlelength=3.2
    )
    return fig


def bytes_per_param(records: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    """Per record, ``{part: bytes per param}`` for every part of :data:`PARTS`."""
    out = []
    for record in records:
        parts = record.get("parts_bytes")
        if parts is None:
            raise ValueError(
                f"the record of {record['variant']!r} has no 'parts_bytes': measure them with "
                "python -m benchmarks.memory_ladder bytes <profile>"
            )
        n = record["n_params"]
        out.append({key: parts.get(key, 0) / n for key, _, _ in PARTS})
    return out


def _tiny(sizes: Sequence[int]) -> str:
    """What a part too thin to see holds in all, in the legend: ``8 B in all`` or ``up to 12 B in all``."""
    present = {size for size in sizes if size}
    most = max(present)
    amount = f"{most:,} B" if most < 10_000 else f"{most / 1024:,.0f} KiB"
    return f"{amount} in all" if len(present) == 1 else f"up to {amount} in all"


def bytes_figure(records: Sequence[Mapping[str, Any]]) -> Any:
    """Bytes per param on one device, stacked by part, beside the total per device under ZeRO-1."""
    import numpy as np

    per_param = bytes_per_param(records)
    names = [r["variant"] for r in records]
    zero = [r.get("zero_bytes_per_param_device0") for r in records]
    devices = records[0].get("zero_devices", 8)
    fig, ax = _figure(1.75 + 0.5 * len(records))
    y = np.arange(len(records), dtype=float)
    height = 0.38
    left = np.zeros(len(records))
    for key, label, colour in PARTS:
        widths = np.asarray([p[key] for p in per_param])
        if not widths.any():
            continue
        if widths.max() < 0.02:  # a few bytes in all: in the legend, too thin to see as a bar
            label = f"{label} ({_tiny([r['parts_bytes'].get(key, 0) for r in records])})"
        ax.barh(y - height / 2, widths, height, left=left, color=colour, label=label)
        left += widths
    for yi, total in zip(y, left, strict=True):
        ax.text(total + 0.1, yi - height / 2, f"{total:.2f}", va="center", fontsize=FONT_PT)
    shown = np.asarray([np.nan if z is None else z for z in zero], float)
    if np.isfinite(shown).any():
        ax.barh(
            y + height / 2,
            shown,
            height,
            color=ZERO_COLOUR,
            label=f"all of it, per device, ZeRO-1 over {devices}",
        )
        for yi, z in zip(y, shown, strict=True):
            if np.isfinite(z):
                ax.text(z + 0.1, yi + height / 2, f"{z:.2f}", va="center", fontsize=FONT_PT, color="0.25")
    ax.set_yticks(y, names, fontsize=FONT_PT)
    ax.invert_yaxis()
    ax.set_xlim(0, max(left.max(), np.nanmax(shown) if np.isfinite(shown).any() else 0) * 1.12)
    ax.tick_params(axis="x", labelsize=FONT_PT)
    ax.set_xlabel("bytes per parameter", fontsize=FONT_PT)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    ax.set_title(f"Params + optimizer, bytes per parameter\n{records[0]['config']}", fontsize=FONT_PT + 0.5)
    fig.legend(loc="outside lower center", ncol=2, fontsize=FONT_PT, frameon=False)
    return fig


def save(fig: Any, path: Path) -> None:
    """``fig`` as a PNG of :data:`WIDTH_PX` x :data:`SCALE` pixels' width, everything inside it."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
