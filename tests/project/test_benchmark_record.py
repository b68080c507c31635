"""Every benchmark figure the pages quote comes from one recorded source, ``benchmarks/record.json``.

- Each recorded case says which command produced it, when and on what machine.
- The case's section in docs/benchmarks.md quotes each of its figures and its date.
- Outside docs/benchmarks.md (whose other cases print their own tables), a page's
  prose quotes a time or a size (``ms``, ``MiB``, ``GiB``) only as recorded:
  sharding.md once quoted 397 and 447 ms for the ZeRO step where the
  benchmark page gave 113.8 and 133.7 ms.
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
