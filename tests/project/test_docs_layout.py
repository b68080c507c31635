"""The pages fit a 1280 px window: tables show every column, figures show at the size they were drawn.

Material's content column is 688 px wide in a 1280 px window (measured in
Chromium, with the navigation and the table of contents beside it), and a
notebook's output area 584 px. A table wider than the column hides its last
columns behind a scrollbar; an image wider than its place is scaled down, and
text drawn at 9 points becomes 7 px tall. So:

- a markdown table has at most :data:`MAX_TABLE_COLUMNS` columns (the memory
  ladder's table of eight hid its step times at both 1280 and 1920 px);
- every image a page shows exists, names its width, no wider than the
  column, and is drawn for that width (as many pixels, or twice as many for
  sharp screens); every image under ``docs/img/`` is shown by some page;
- a notebook's figures are no wider than its output area;
- the memory ladder's figures (``benchmarks/_ladder_figures.py``) are drawn at
  the width the pages give them, with no text under 12 px as shown, no label
  under the legend, and a style of its own for every variant.
"""

from __future__ import annotations

import base64
import json
import re
import struct
from pathlib import Path

import pytest

from _helpers import FENCE

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))

CONTENT_PX = 688  # the content column at 1280 px
NOTEBOOK_OUTPUT_PX = 584  # a notebook cell's output area at 1280 px
MAX_TABLE_COLUMNS = 5

_TABLE_ROW = re.compile(r"^\s*\|.*\|\s*$")
_DELIMITER = re.compile(r"^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")
_IMAGE = re.compile(r"!\[[^\]]*\]\((?P<src>[^)\s]+)\)(?:\{(?P<attrs>[^}]*)\})?")
_HTML_IMAGE = re.compile(r"<img\b[^>]*\bsrc=\"(?P<src>[^\"]+)\"[^>]*>")
_WIDTH = re.compile(r"\bwidth=\"?(\d+)")


def _prose(text: str) -> str:
    """``text`` with its fenced code blocks (whose lines may look like tables) blanked, lines kept."""
    return FENCE.sub(lambda block: "\n" * block[0].count("\n"), text)


def _cells(row: str) -> list[str]:
    # Escaped pipes (\|) stay inside their cell, as Python-Markdown reads them.
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def table_widths(text: str) -> list[tuple[int, int]]:
    """``(line number, columns)`` of every markdown table in ``text``'s prose."""
    lines = _prose(text).splitlines()
    found = []
    for i in range(1, len(lines)):
        if _DELIMITER.match(lines[i]) and _TABLE_ROW.match(lines[i - 1]):
            found.append((i, len(_cells(lines[i - 1]))))  # the header's line number, from 1
    return found


def test_tables_are_found():
    text = "a\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n```py\n| x | y | z |\n|---|---|---|\n```\n| a \\| b | c | d |\n|---|:-:|--:|\n"
    assert table_widths(text) == [(3, 2), (11, 3)]


@pytest.mark.parametrize("page", PAGES)
def test_tables_fit_the_column(page):
    wide = [(line, n) for line, n in table_widths((DOCS / page).read_text()) if n > MAX_TABLE_COLUMNS]
    assert not wide, (
        f"docs/{page}: tables of more than {MAX_TABLE_COLUMNS} columns (line, columns) hide their last "
        f"columns behind a scrollbar at 1280 px; split them: {wide}"
    )


def png_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` from a PNG's header."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def images(text: str) -> list[tuple[str, int | None]]:
    """``(src, width attribute or None)`` of every image ``text`` shows."""
    prose = _prose(text)
    found = []
    for match in _IMAGE.finditer(prose):
        width = _WIDTH.search(match["attrs"] or "")
        found.append((match["src"], int(width[1]) if width else None))
    for match in _HTML_IMAGE.finditer(prose):
        width = _WIDTH.search(match[0])
        found.append((match["src"], int(width[1]) if width else None))
    return found


def test_images_are_found():
    text = (
        '![a](img/a.png){ width="680" }\n![b](b.png)\n<img src="c.png" width="300">\n```\n![d](d.png)\n```\n'
    )
    assert images(text) == [("img/a.png", 680), ("b.png", None), ("c.png", 300)]


def _image_problems(page: str, src: str, width: int | None) -> list[str]:
    path = (DOCS / page).parent / src
    if "://" in src or not path.is_file():
        return [f"{src}: no such file under docs/"]
    if width is None:
        return [f'{src}: no width (write ![...]({src}){{ width="..." }})']
    problems = []
    if width > CONTENT_PX:
        problems.append(f"{src}: {width} px, wider than the {CONTENT_PX} px column")
    if path.suffix == ".png":
        natural, _ = png_size(path.read_bytes())
        if natural not in (width, 2 * width):
            problems.append(
                f"{src}: {natural} px drawn, {width} px shown: scaled, its text no longer as drawn"
            )
    return problems


@pytest.mark.parametrize("page", PAGES)
def test_images_show_at_the_width_they_were_drawn_for(page):
    problems = [
        p for src, width in images((DOCS / page).read_text()) for p in _image_problems(page, src, width)
    ]
    assert not problems, f"docs/{page}: {problems}"


def test_image_problems_are_caught(tmp_path, monkeypatch):
    figure = DOCS / "img" / "memory-ladder-bytes.png"
    natural, _ = png_size(figure.read_bytes())
    assert _image_problems("low-bit-state.md", "img/memory-ladder-bytes.png", natural // 2) == []
    assert _image_problems("low-bit-state.md", "img/missing.png", 600) == [
        "img/missing.png: no such file under docs/"
    ]
    assert len(_image_problems("low-bit-state.md", "img/memory-ladder-bytes.png", None)) == 1
    wide, scaled = natural // 2 + 100, natural // 2 - 100
    assert "wider than" in " ".join(_image_problems("low-bit-state.md", "img/memory-ladder-bytes.png", wide))
    assert "scaled" in " ".join(_image_problems("low-bit-state.md", "img/memory-ladder-bytes.png", scaled))


def test_every_image_under_docs_img_is_shown():
    shown = {
        ((DOCS / page).parent / src).resolve()
        for page in PAGES
        for src, _ in images((DOCS / page).read_text())
    }
    unshown = sorted(p.name for p in (DOCS / "img").iterdir() if p.resolve() not in shown)
    assert not unshown, (
        f"images under docs/img/ that no page shows: {unshown} (a benchmark run redrew a figure: "
        'show it where its figures are discussed, as ![...](img/NAME){ width="680" })'
    )


@pytest.mark.parametrize("notebook", sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")))
def test_notebook_figures_fit_the_output_area(notebook):
    cells = json.loads((ROOT / "notebooks" / notebook).read_text())["cells"]
    wide = []
    for index, cell in enumerate(cells):
        for output in cell.get("outputs", []):
            png = output.get("data", {}).get("image/png")
            if png:
                width, _ = png_size(base64.b64decode("".join(png)))
                if width > NOTEBOOK_OUTPUT_PX:
                    wide.append((index, width))
    assert not wide, (
        f"{notebook}: figures (cell, px) wider than the docs' {NOTEBOOK_OUTPUT_PX} px output area, shown "
        f"scaled down with their text: {wide}; draw them narrower (figsize x dpi)"
    )


# -- the memory ladder's figures ---------------------------------------------------


def _records(control_gap: float) -> list[dict]:
    """Records as the case writes them, for the variants it runs, with made-up losses and exact bytes."""
    import numpy as np

    from benchmarks import memory_ladder

    steps, n = 120, 1000
    rng = np.random.default_rng(0)
    base = 2.3 + 2.0 * np.exp(-np.arange(steps) / 15) + 0.1 * rng.standard_normal(steps)
    records = []
    for index, (variant, spec) in enumerate(
        {**memory_ladder.VARIANTS, **memory_ladder.ROUNDING_VARIANTS}.items()
    ):
        dtype, master, bits, rounding = spec
        control = dtype != "float32" and master is None and rounding is None
        offset = control_gap if control else 0.002 * index
        params = (2 if dtype == "bfloat16" else 4) * n
        parts = {
            "params": params,
            "master": 4 * n if master else 0,
            "compensation": params if rounding == "kahan" else 0,
            "rounding_key": 8 if rounding == "stochastic" else 0,
            "moments": {8: 2050, 4: 1050}.get(bits, 8 * n),
            "counts": 12,
            "other": 0,
        }
        records.append(
            {
                "variant": variant,
                "config": "adamw, transformer 4 x 256, 8 x 64 chars, 200 steps",
                "spec": dict(zip(memory_ladder.SPEC_FIELDS, spec, strict=True)),
                "n_params": n,
                "parts_bytes": parts,
                "zero_bytes_per_param_device0": sum(parts.values()) / n / 4,
                "losses": (base + offset * np.linspace(0, 1, steps)).tolist(),
            }
        )
    return records


def _texts(fig):
    from matplotlib.text import Text

    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]


@pytest.fixture(scope="module")
def figures():
    import matplotlib

    matplotlib.use("Agg")
    from benchmarks import _ladder_figures

    drawn = {
        "loss, control far off": _ladder_figures.loss_figure(_records(control_gap=0.4)),
        "loss, control near": _ladder_figures.loss_figure(_records(control_gap=0.01)),
        "bytes": _ladder_figures.bytes_figure(_records(control_gap=0.0)),
    }
    for fig in drawn.values():
        fig.canvas.draw()
    yield drawn
    import matplotlib.pyplot as plt

    plt.close("all")


def test_ladder_figures_are_drawn_for_the_column(figures, tmp_path):
    from benchmarks import _ladder_figures

    assert _ladder_figures.WIDTH_PX <= CONTENT_PX
    for name, fig in figures.items():
        path = tmp_path / f"{name}.png"
        fig.savefig(path)
        width, height = png_size(path.read_bytes())
        assert width == _ladder_figures.SCALE * _ladder_figures.WIDTH_PX, name
        assert height < 2 * width, name  # a page's figure, not a scroll


def test_ladder_figures_text_is_readable_at_the_page_width(figures):
    from benchmarks import _ladder_figures

    shown_px_per_point = _ladder_figures.DPI / 72  # stored at SCALE x, shown at 1 x
    assert _ladder_figures.MIN_TEXT_PX >= 12
    for name, fig in figures.items():
        small = [
            (t.get_text(), t.get_fontsize())
            for t in _texts(fig)
            if t.get_fontsize() * shown_px_per_point < _ladder_figures.MIN_TEXT_PX
        ]
        assert not small, f"{name}: text under {_ladder_figures.MIN_TEXT_PX} px as shown: {small}"


def test_ladder_bytes_labels_stay_clear_of_the_legend_and_each_other(figures):
    fig = figures["bytes"]
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    labels = [t for t in fig.axes[0].texts]
    assert len(labels) == 2 * len(_records(0.0))  # a total on every bar
    extents = [t.get_window_extent(renderer) for t in labels]
    assert not [t.get_text() for t, e in zip(labels, extents, strict=True) if e.overlaps(box)]
    axes = fig.axes[0].get_window_extent(renderer)
    assert all(axes.x0 <= e.x0 and e.x1 <= axes.x1 for e in extents), "a label runs out of the plot"
    for i, a in enumerate(extents):
        for b in extents[i + 1 :]:
            assert not a.overlaps(b)


def test_ladder_bytes_name_every_part(figures):
    (legend,) = figures["bytes"].legends
    entries = [t.get_text() for t in legend.get_texts()]
    for expected in ("params", "float32 master copy", "Kahan compensation buffer", "stochastic-rounding key"):
        assert any(e.startswith(expected) for e in entries), (expected, entries)
    assert any(e.startswith("moments") for e in entries)
    assert not any("counts" in e and "moments" in e for e in entries)  # each part its own entry
    key = next(e for e in entries if e.startswith("stochastic-rounding key"))
    assert "8 B in all" in key  # too thin to see as a bar: its size is in the legend


def test_ladder_loss_curves_are_told_apart(figures):
    from benchmarks import memory_ladder

    for name, fig in figures.items():
        if not name.startswith("loss"):
            continue
        (legend,) = fig.legends
        labels = [t.get_text() for t in legend.get_texts()]
        expected = [
            v for v in {**memory_ladder.VARIANTS, **memory_ladder.ROUNDING_VARIANTS} if v != "float32 AdamW"
        ]
        assert labels == expected, name  # every variant but the baseline, whose curve is the line at 0
        colours = [h.get_color() for h in legend.legend_handles]
        assert len(set(colours)) == len(colours), f"{name}: two variants share a colour: {colours}"
    # The control far off: a second panel shows the others at their own scale.
    assert len(figures["loss, control far off"].axes) == 2
    assert len(figures["loss, control near"].axes) == 1
    zoomed = figures["loss, control far off"].axes[1]
    assert "plain bf16" not in [line.get_label() for line in zoomed.get_lines()]


def test_ladder_table_fits_the_column():
    from benchmarks import memory_ladder

    records = [
        {
            **r,
            "bytes_per_param": 1.0,
            "optimizer_bytes_per_param": 1.0,
            "final_loss": 2.0,
            "loss_vs_float32": 1.0,
            "held_out_loss": 2.0,
            "time_vs_float32": 1.0,
        }
        for r in _records(0.0)
    ]
    text = memory_ladder.ladder_table(records)
    assert [n for _, n in table_widths(text)] == [4, 5]
    assert "held-out loss" in text and "step time" in text
