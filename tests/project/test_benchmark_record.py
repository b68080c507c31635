"""Every benchmark figure the pages quote comes from one recorded source, ``benchmarks/record.json``.

- Each recorded case says which command produced it, when and on what machine.
- The case's section in docs/benchmarks.md quotes each of its figures and its date.
- Outside docs/benchmarks.md (whose other cases print their own tables), a page's
  prose quotes a time or a size (``ms``, ``MiB``, ``GiB``) only as recorded:
  sharding.md once quoted 397 and 447 ms for the ZeRO step where the
  benchmark page gave 113.8 and 133.7 ms.
- The memory ladder (case 12) is discussed on three pages: wherever a page
  writes about it (a section whose heading names it, a paragraph that does),
  its tables give each variant's recorded figures by row and column, and its
  prose quotes only recorded figures. mixed-precision.md once gave 1.0002x
  and 6.050 where low-bit-state.md gave 1.0014x and 6.049.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from _helpers import FENCE

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RECORD = json.loads((ROOT / "benchmarks" / "record.json").read_text())
FIGURE = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?) ?(ms|MiB|GiB)\b")


def recorded() -> set[str]:
    return {figure for case in RECORD["cases"].values() for figure in case["figures"].values()}


def quoted(text: str) -> list[str]:
    """The times and sizes quoted in ``text``'s prose (code blocks are examples, not figures)."""
    prose = FENCE.sub("", text)
    return [f"{number} {unit}" for number, unit in FIGURE.findall(prose)]


def section(case: int) -> str:
    text = (DOCS / "benchmarks.md").read_text()
    start = text.index(f"### {case}. ")
    end = text.find("\n### ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_each_case_says_what_when_and_where():
    for name, case in RECORD["cases"].items():
        assert case["command"].startswith("python -m benchmarks."), name
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", case["date"]), name
        assert case["machine"] and case["figures"], name


@pytest.mark.parametrize("name", sorted(RECORD["cases"]))
def test_the_benchmark_page_quotes_the_record(name):
    case = RECORD["cases"][name]
    text = section(case["case"])
    assert case["date"] in text, f"case {case['case']}: the section does not give the record's date"
    missing = [figure for figure in case["figures"].values() if figure not in text]
    assert not missing, f"case {case['case']} does not quote these recorded figures: {missing}"


PAGES = sorted(
    [p.relative_to(ROOT).as_posix() for p in DOCS.rglob("*.md") if p.name != "benchmarks.md"] + ["README.md"]
)


@pytest.mark.parametrize("page", PAGES)
def test_pages_quote_only_recorded_figures(page):
    unrecorded = [figure for figure in quoted((ROOT / page).read_text()) if figure not in recorded()]
    assert not unrecorded, f"{page} quotes figures that benchmarks/record.json does not hold: {unrecorded}"


def test_an_unrecorded_figure_is_caught():
    text = "The step took 397 ms and 447 ms.\n\n```python\nx = 5  # 12 ms in a code block\n```\n"
    assert [f for f in quoted(text) if f not in recorded()] == ["397 ms", "447 ms"]


# -- the memory ladder: its figures wherever a page discusses it -------------------------------

LADDER = RECORD["cases"]["memory_ladder"]["figures"]
# A table's column as the record names its figures.
LADDER_COLUMNS = {
    "optimizer B/param": "optimizer B/param",
    "+ params": "B/param with params",
    "ZeRO-1, per device": "ZeRO-1 B/param per device",
    "final loss": "final loss",
    "\u00d7 float32": "final loss x float32",
    "held-out": "held-out loss",
    "time": "step time x float32",
}
# The ladder's figures are written with three or four decimals (bytes per param, losses, ratios);
# a version number (0.10.2) or a count (3,222,016) is not one of them.
LADDER_FIGURE = re.compile(r"(?<![\d.])\d+\.\d{3,4}(?![\d.])")
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.*)$", re.M)


def ladder_passages(text: str) -> list[str]:
    """The prose of ``text`` about the memory ladder: sections whose heading names it, and paragraphs that do."""
    prose = FENCE.sub("", text)
    headings = list(_HEADING.finditer(prose))
    passages = []
    for i, heading in enumerate(headings):
        if "memory ladder" in heading[2].casefold():
            level = len(heading[1])
            end = next((h.start() for h in headings[i + 1 :] if len(h[1]) <= level), len(prose))
            passages.append(prose[heading.end() : end])
    in_sections = "\n".join(passages)
    passages += [
        paragraph
        for paragraph in re.split(r"\n[ \t]*\n", prose)
        if "memory ladder" in paragraph.casefold() and paragraph not in in_sections
    ]
    return passages


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


def ladder_quotes(text: str) -> tuple[int, list[str]]:
    """``(figures read, misquotes)`` of the memory ladder in ``text``.

    A table whose first column is the variant gives each cell a figure of the
    record by its row and column, which it must be; elsewhere a number written
    as the ladder writes them must be one of its recorded figures.
    """
    recorded_figures = set(LADDER.values())
    read, wrong = 0, []
    for passage in ladder_passages(text):
        header: list[str] | None = None
        for line in passage.splitlines():
            if not line.lstrip().startswith("|"):
                header = None
            elif _cells(line)[0] == "variant":
                header = _cells(line)
                continue
            elif header is not None and not set("".join(_cells(line))) <= set("-: "):
                variant, cells = _cells(line)[0], _cells(line)[1:]
                for column, cell in zip(header[1:], cells, strict=True):
                    figure = LADDER.get(f"{variant}, {LADDER_COLUMNS.get(column, column)}")
                    read += 1
                    if cell != figure:
                        wrong.append(f"{variant} | {column}: {cell} (recorded: {figure})")
                continue
            for number in LADDER_FIGURE.findall(line):
                read += 1
                if number not in recorded_figures:
                    wrong.append(number)
    return read, wrong


@pytest.mark.parametrize("page", [*PAGES, "docs/benchmarks.md"])
def test_pages_quote_the_memory_ladder_as_recorded(page):
    """mixed-precision.md once gave 1.0002x and 6.050 where the ladder's tables gave 1.0014x and 6.049."""
    _, wrong = ladder_quotes((ROOT / page).read_text())
    assert not wrong, (
        f"{page} quotes memory-ladder figures that benchmarks/record.json does not hold: {wrong}"
    )


@pytest.mark.parametrize(
    ("page", "at_least"),
    [("docs/low-bit-state.md", 70), ("docs/benchmarks.md", 70), ("docs/mixed-precision.md", 6)],
)
def test_the_pages_that_discuss_the_ladder_are_read(page, at_least):
    read, _ = ladder_quotes((ROOT / page).read_text())
    assert read >= at_least, f"{page}: {read} memory-ladder figures read, expected at least {at_least}"


def test_a_memory_ladder_misquote_is_caught():
    text = (
        "## Other\n\nStochastic rounding at 1.0002\u00d7 (not the ladder: JAX 0.10.2).\n\n"
        "On the memory ladder, stochastic rounding ends at 1.0002\u00d7 and Kahan with 8-bit state at 6.050;\n"
        "Kahan at 0.9979\u00d7.\n\n```python\nx = 6.050  # code, not a figure\n```\n\n"
        "## Measured: the memory ladder\n\n| variant | final loss | \u00d7 float32 |\n|---|---|---|\n"
        "| bf16 + kahan | 2.3306 | 1.0014 |\n\nIt ends at 1.0135\u00d7.\n\n## Next\n\n1.2345\n"
    )
    assert ladder_quotes(text) == (
        6,
        ["bf16 + kahan | \u00d7 float32: 1.0014 (recorded: 0.9979)", "1.0002", "6.050"],
    )
