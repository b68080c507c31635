"""The documentation holds what it promises.

- Every public class and function (``treeopt.__all__``, the ``__all__`` of the
  public modules it lists, and ``treeopt.t5x``) has a docstring with a runnable
  ``>>>`` example, and every public module a docstring;
  ``pytest --doctest-modules`` (the project's default options) executes them.
- Every page named in the ``nav`` of ``mkdocs.yml`` exists.
- The guides run: in the pages of ``RUNNABLE_PAGES`` every fenced block marked
  ```` ```python ```` is executed, in page order, in one namespace per page
  (in the slow tier: ``python -m pytest -n 2 -m slow``). Blocks that only show
  code (other libraries, fragments) are marked ```` ```py ````, which renders
  the same. Each page runs in a fresh Python without the test run's
  ``XLA_FLAGS``, as a reader pastes it: a page that needs several devices
  sets them at its top.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

import treeopt

from _helpers import FENCE, python_blocks

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

PUBLIC_MODULES = (
    "treeopt",
    "treeopt.serialization",
    "treeopt.checkpoint",
    "treeopt.errors",
    "treeopt.keys",
    "treeopt.step",
    "treeopt.typing",
    "treeopt.partitioning",
    "treeopt.t5x",
    "treeopt.nnx",
)

RUNNABLE_PAGES = [
    "getting-started.md",
    "optimizer.md",
    "serialization.md",
    "resume.md",
    "mixed-precision.md",
    "low-bit-state.md",
    "t5x.md",
    "migration/from-optax.md",
    "migration/from-flax-optim.md",
    "migration/from-treex.md",
    "migration/from-nnx.md",
    "migration/from-t5x.md",
]


# -- public names have examples ----------------------------------------------------


def _public_modules() -> list[types.ModuleType]:
    """The public modules that exist in this checkout (each lands with its own issue)."""
    return [importlib.import_module(name) for name in PUBLIC_MODULES if importlib.util.find_spec(name)]


def _documentable(obj: Any) -> bool:
    if inspect.ismodule(obj):
        return True
    # Names of other libraries kept for a drop-in's sake (T5X's ``Dtype = Any``) are theirs to document.
    own = getattr(obj, "__module__", "").startswith("treeopt")
    return own and (inspect.isclass(obj) or inspect.isfunction(obj))


def _public_objects() -> dict[str, Any]:
    """``{qualified name: object}`` for every documented public class, function and module."""
    found: dict[str, Any] = {}
    pending = [(module.__name__, module) for module in _public_modules()]
    while pending:
        prefix, module = pending.pop()
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if not _documentable(obj):
                continue  # constants and type aliases
            qualified = f"{prefix}.{name}"
            if inspect.ismodule(obj):
                if not obj.__name__.startswith("treeopt"):
                    continue
                pending.append((qualified, obj))
            if any(obj is seen for seen in found.values()) and not inspect.ismodule(obj):
                continue  # re-exported under another public name: checked once
            found[qualified] = obj
    return found


PUBLIC = _public_objects()


def test_public_names_are_collected():
    assert "treeopt.Optimizer" in PUBLIC
    assert "treeopt.mask" in PUBLIC


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_name_has_a_docstring_with_an_example(name):
    obj = PUBLIC[name]
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"{name} has no docstring"
    if inspect.ismodule(obj):
        return  # a module needs a docstring; its public names need the examples
    assert ">>>" in doc, f"the docstring of {name} has no '>>>' example"


def test_optimizer_methods_have_examples():
    own = [cls for cls in treeopt.Optimizer.__mro__ if cls.__module__.startswith("treeopt")]
    assert len(own) > 1  # its bases hold methods too (hyperparameters, views, partition_specs)
    members = {name: member for cls in reversed(own) for name, member in vars(cls).items()}
    assert {"hyperparams", "set_hyperparams", "partition_specs", "ema_params", "update"} <= set(members)
    missing = [
        name
        for name, member in members.items()
        if not name.startswith("_") and inspect.isfunction(member) and ">>>" not in (member.__doc__ or "")
    ]
    assert not missing, f"Optimizer methods without a '>>>' example: {missing}"


# -- the API reference names every public object ----------------------------------

_DIRECTIVE = re.compile(r"^:::[ \t]*(\S+)", re.M)
_CODE_WORD = re.compile(r"`([A-Za-z_]\w*)`")


def _resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"cannot resolve {dotted}")


def test_api_reference_covers_every_public_name():
    """Each name in a public ``__all__`` is rendered by a ``::: target`` of docs/api/*.md,
    or (for families such as the wrapped optax aliases of treeopt.t5x) named there in code."""
    text = "\n".join(page.read_text() for page in sorted((DOCS / "api").glob("*.md")))
    rendered = [_resolve(target) for target in _DIRECTIVE.findall(text)]
    named = set(_CODE_WORD.findall(text))
    modules = [obj for obj in PUBLIC.values() if inspect.ismodule(obj)] + _public_modules()
    missing = sorted(
        {
            f"{module.__name__}.{name}"
            for module in modules
            for name in module.__all__
            if not any(getattr(module, name) is obj for obj in rendered) and name not in named
        }
    )
    assert not missing, f"public names missing from the API reference (docs/api/*.md): {missing}"


# -- docstrings as the API reference renders them -------------------------------------


def _rendered_docstring(doc: str) -> str:
    """``doc`` as docs/griffe_docstrings.py hands it to mkdocstrings (its Markdown)."""
    spec = importlib.util.spec_from_file_location("griffe_docstrings", DOCS / "griffe_docstrings.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    obj = types.SimpleNamespace(docstring=types.SimpleNamespace(value=doc))
    module.TreeoptDocstrings().on_object(obj=obj)
    return obj.docstring.value


def test_rest_literal_blocks_become_fenced_code():
    doc = "Swap the name::\n\n    a = 1  # before\n\n    b = 2\n\nThen ::\n\n    c\n\nA plain line: not a block.\n"
    assert _rendered_docstring(doc) == (
        "Swap the name:\n\n```python\na = 1  # before\n\nb = 2\n```\n\nThen\n\n```python\nc\n```\n\n"
        "A plain line: not a block.\n"
    )


def _docstrings() -> dict[str, str]:
    """Every docstring the API reference renders: public objects and their public members."""
    found = {}
    for name, obj in PUBLIC.items():
        found[name] = inspect.getdoc(obj) or ""
        if inspect.isclass(obj):
            for member_name, member in vars(obj).items():
                doc = getattr(member, "__doc__", None)
                if not member_name.startswith("_") and isinstance(doc, str):
                    found[f"{name}.{member_name}"] = inspect.cleandoc(doc)
    return found


def test_docstrings_render_no_rest_markup():
    """The nnx API page once showed "nothing else changes::", reST's literal-block marker, as text."""
    shown = {name: _rendered_docstring(doc) for name, doc in _docstrings().items()}
    markers = sorted(name for name, text in shown.items() if re.search(r"::[ \t]*$", text, re.M))
    assert not markers, f"docstrings whose rendered Markdown keeps a reST '::': {markers}"
    assert "```python" in shown["treeopt.nnx"]


# -- the site's navigation ---------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """Reads mkdocs.yml, tolerating the ``!!python/...`` and ``!ENV`` tags mkdocs allows."""


_Loader.add_multi_constructor("", lambda loader, suffix, node: None)


def _nav_pages(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    return []


def _config() -> dict[str, Any]:
    with open(ROOT / "mkdocs.yml") as f:
        return yaml.load(f, Loader=_Loader)


def test_every_nav_page_exists():
    config = _config()
    docs_dir = ROOT / config.get("docs_dir", "docs")
    pages = [p for p in _nav_pages(config["nav"]) if "://" not in p]
    assert pages, "mkdocs.yml has no nav"
    missing = [p for p in pages if not (docs_dir / p).is_file()]
    assert not missing, f"pages named in mkdocs.yml nav that do not exist under {docs_dir.name}/: {missing}"


def test_every_page_is_in_the_nav():
    config = _config()
    docs_dir = ROOT / config.get("docs_dir", "docs")
    in_nav = set(_nav_pages(config["nav"]))
    on_disk = {
        p.relative_to(docs_dir).as_posix()
        for p in docs_dir.rglob("*")
        if p.suffix in {".md", ".ipynb"} and ".ipynb_checkpoints" not in p.parts
    }
    assert not on_disk - in_nav, f"pages missing from the nav of mkdocs.yml: {sorted(on_disk - in_nav)}"


def _top_level_entries(config: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """``(title, pages)`` of each entry at the top of the nav: a page, or a section and its pages."""
    entries = []
    for item in config["nav"]:
        for title, value in item.items() if isinstance(item, dict) else [(item, item)]:
            entries.append((title, _nav_pages(value)))
    return entries


_LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]+)\]\((?P<target>[^)#\s]+)(?:#[^)\s]*)?\)")


def test_the_index_points_to_every_part_of_the_site():
    """ "Where to go next" links every page at the top of the nav, and a page of every section."""
    index = (DOCS / "index.md").read_text()
    linked = {m["target"] for m in _LINK.finditer(index.split("## Where to go next", 1)[1])}
    missing = [
        title
        for title, pages in _top_level_entries(_config())
        if pages != ["index.md"] and not linked & set(pages)
    ]
    assert not missing, f'docs/index.md\'s "Where to go next" does not link: {missing}'


def _guide_titles() -> dict[str, str]:
    """``{page: nav title}`` of the guides at the top of the nav (not the API reference, notebooks or migration guides)."""
    return {pages[0]: title for title, pages in _top_level_entries(_config()) if len(pages) == 1}


def misnamed_links(page: str, text: str, titles: dict[str, str]) -> list[str]:
    """Links in ``text`` (a page at ``page``) that call a guide by another name than its nav title.

    A link's words may name a section after the title ("Sharding: ZeRO-1",
    "Benchmarks, case 10") or be the title in lower case; a link in code
    (`` [`treeopt.t5x`](t5x.md) ``) names an object, not a page.
    """
    found = []
    for match in _LINK.finditer(FENCE.sub("", text)):
        words, target = match["text"], match["target"]
        if "://" in target or words.startswith("`"):
            continue
        title = titles.get(os.path.normpath((Path(page).parent / target).as_posix()))
        if title is None:
            continue
        if not re.match(re.escape(title.casefold()) + r"($|[:,] )", words.casefold()):
            found.append(f"[{words}]({target}): the page is called {title!r}")
    return found


def test_misnamed_links_are_found():
    titles = {"mixed-precision.md": "Narrow params", "sharding.md": "Sharding"}
    text = (
        "[Mixed precision](mixed-precision.md) [narrow params](mixed-precision.md#x) "
        "[Sharding: ZeRO-1](sharding.md) [Sharding the state](../sharding.md) [`x`](sharding.md) "
        "![Sharding](sharding.md)"
    )
    # From docs/index.md, ../sharding.md is no page of the site; from a migration guide it is sharding.md.
    assert misnamed_links("index.md", text, titles) == [
        "[Mixed precision](mixed-precision.md): the page is called 'Narrow params'"
    ]
    assert misnamed_links("migration/page.md", text, titles) == [
        "[Sharding the state](../sharding.md): the page is called 'Sharding'"
    ]


@pytest.mark.parametrize("page", sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")))
def test_links_call_a_guide_by_its_one_name(page):
    """A guide goes by its nav title everywhere ("Narrow params" once also went by "Mixed precision")."""
    misnamed = misnamed_links(page, (DOCS / page).read_text(), _guide_titles())
    assert not misnamed, f"docs/{page}: {misnamed}"


def test_every_notebook_is_in_the_docs():
    notebooks = {p.name for p in (ROOT / "notebooks").glob("*.ipynb")}
    in_nav = {Path(p).name for p in _nav_pages(_config()["nav"]) if p.endswith(".ipynb")}
    assert notebooks <= in_nav, f"notebooks missing from the docs nav: {sorted(notebooks - in_nav)}"


# -- the guides run ----------------------------------------------------------------


def test_python_blocks_are_found():
    text = 'a\n```python\nx = 1\n```\n```py\nskipped\n```\n    ```python title="t"\n    y = 2\n    ```\n'
    assert python_blocks(text) == [(3, "x = 1\n"), (9, "y = 2\n")]


# Each page runs in a fresh Python, as a reader pastes it: in page order, in one namespace, in a
# real module (classes defined on the page, dataclasses and flax structs, find it), and without
# this run's XLA_FLAGS: a page that needs several devices sets them itself, before JAX starts.
# Its blocks are compiled padded with newlines, so tracebacks point at the page's own lines.
_PASTED = """
import json, sys, types, warnings
warnings.filterwarnings("error", r"treeopt\\..* moved", DeprecationWarning)
page, name, blocks = json.loads(sys.argv[1])
module = types.ModuleType(name)
sys.modules[name] = module
for line, code in blocks:
    exec(compile("\\n" * (line - 1) + code, page, "exec", dont_inherit=True), module.__dict__)
"""


@pytest.mark.slow  # over a minute of compiling in all: the slow tier (-m slow) runs them
@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_guide_runs(page, tmp_path):
    path = DOCS / page
    assert path.is_file(), f"docs/{page} is listed as runnable but does not exist"
    blocks = python_blocks(path.read_text())
    assert blocks, f"docs/{page} has no ```python block"
    name = "docs_" + re.sub(r"\W", "_", page.removesuffix(".md"))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(
        [sys.executable, "-c", _PASTED, json.dumps([f"docs/{page}", name, blocks])],
        cwd=tmp_path,  # anything a guide writes lands in a temporary folder
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"docs/{page}:\n{done.stderr[-4000:]}"


# -- readers are pointed to public names ---------------------------------------------

# A private module of treeopt (treeopt._step.statistics, treeopt/_sharding/zero.py), a test
# folder or file of this repository (tests/sharding/test_zero.py, test_zero.py): names a reader
# of the guides cannot import, or that say where a check lives instead of what it checks.
_PRIVATE_NAME = re.compile(
    r"\btreeopt(?:[./]\w+)*?[./]_(?!_)\w[\w./]*|(?<![\w/.])tests/[\w./]*|\btest_\w+\.py\b"
)


def private_names(text: str) -> list[str]:
    """The private modules and test paths ``text`` names, prose and code alike."""
    return _PRIVATE_NAME.findall(text)


def test_private_names_are_found():
    text = (
        "See `treeopt/_step/statistics.py`, `treeopt._sharding.zero`, `treeopt.t5x._zero` and "
        "`tests/sharding/test_zero.py`;\n"
        "`python -m pytest tests/project` runs test_docs.py.\n"
        "Public: `treeopt.partitioning.zero_report`, `treeopt.nnx`, `treeopt.t5x.optimizers`, "
        "`treeopt.Optimizer.__init__`, T5X's `optimizers_test.py`, "
        "`docs/migration/from-nnx.md`, `benchmarks/record.json`, my_tests/x.\n"
    )
    assert private_names(text) == [
        "treeopt/_step/statistics.py",
        "treeopt._sharding.zero",
        "treeopt.t5x._zero",
        "tests/sharding/test_zero.py",
        "tests/project",
        "test_docs.py",
    ]


def _reader_pages() -> list[str]:
    """The site's pages a reader reads as written: guides and notebooks, not the generated API reference."""
    pages = [p for p in DOCS.rglob("*.md") if "api" not in p.relative_to(DOCS).parts]
    return sorted(p.relative_to(ROOT).as_posix() for p in [*pages, *(ROOT / "notebooks").glob("*.ipynb")])


@pytest.mark.parametrize("page", _reader_pages())
def test_pages_name_no_private_module_or_test_file(page):
    """Pages once sent readers to treeopt/_step/statistics.py and tests/sharding/test_zero.py."""
    named = private_names((ROOT / page).read_text())
    assert not named, (
        f"{page} names private modules or test files {named}: name the public function, page or command "
        "instead, or say what the test suite checks"
    )


# -- numbers the README repeats ------------------------------------------------------


def test_readme_counts_the_parity_list():
    from _cases import TRANSFORMATIONS

    readme = (ROOT / "README.md").read_text()
    assert f"Parity: for {len(TRANSFORMATIONS)} optax transformations" in readme


def test_readme_quotes_the_measured_nnx_figures():
    """The README's nnx.Optimizer ratios are those of docs/benchmarks.md's results, not a rounding of them."""
    row = next(
        line
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("| `flax.nnx.Optimizer`")
    )
    results = (DOCS / "benchmarks.md").read_text().split("## Results", 1)[1]
    measured = next(line for line in results.splitlines() if line.startswith("| `flax.nnx.Optimizer`"))
    figures = re.findall(r"(`nnx\.jit`|split/merge) (\d[\d.]*\u2013\d[\d.]*\u00d7)", row)
    assert len(figures) == 2, row
    for name, figure in figures:
        assert f"{name} {figure}" in measured, (name, figure, measured)


# -- what the rendered site shows ---------------------------------------------------

# Characters of code a page's column shows whole at a 1280 px wide window, in the
# theme's code font (measured in Chromium: 656 px of text at 8.16 px a character),
# and in one column of a side-by-side grid on a page without its table of contents
# (docs/stylesheets/extra.css). Program output, fenced as ```{.text .output}, wraps instead, at
# spaces: a message's long lines read on, but a row of aligned columns (a report's) wrapped
# mid-row is no longer a row, so those must fit as code does.
CODE_COLUMNS = 80
GRID_COLUMNS = 53
_GRID = re.compile(r'<div class="grid" markdown>.*?</div>', re.S)


def _long_code_lines(text: str) -> list[tuple[int, int, str]]:
    """``(line number, length, line)`` of each code line too wide to show whole in ``text``."""
    grids = [match.span() for match in _GRID.finditer(text)]
    found = []
    for match in FENCE.finditer(text):
        if re.search(r"\.output\b", match["info"]):
            continue
        in_grid = any(start <= match.start() < end for start, end in grids)
        limit = GRID_COLUMNS if in_grid else CODE_COLUMNS
        first = text.count("\n", 0, match.start("body")) + 1
        for offset, line in enumerate(textwrap.dedent(match["body"]).splitlines()):
            if len(line) > limit:
                found.append((first + offset, len(line), line))
    return found


def test_long_code_lines_are_found():
    grid = '<div class="grid" markdown>\n\n```py\n' + "g" * 54 + "\n```\n\n</div>\n"
    text = (
        "```python\n"
        + "x" * 80
        + "\n"
        + "y" * 81
        + "\n```\n```{.text .output}\n"
        + "z" * 99
        + "\n```\n"
        + grid
    )
    assert _long_code_lines(text) == [(3, 81, "y" * 81), (11, 54, "g" * 54)]


@pytest.mark.parametrize("page", sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")))
def test_code_lines_show_whole_at_1280px(page):
    """No code line hides behind a horizontal scrollbar on a 1280 px screen."""
    long = _long_code_lines((DOCS / page).read_text())
    assert not long, f"docs/{page}: code lines wider than the column: {long}"


def _long_output_rows(text: str) -> list[tuple[int, int, str]]:
    """``(line number, length, line)`` of each row of aligned columns in program output too wide to show whole."""
    found = []
    for match in FENCE.finditer(text):
        if not re.search(r"\.output\b", match["info"]):
            continue
        first = text.count("\n", 0, match.start("body")) + 1
        for offset, line in enumerate(textwrap.dedent(match["body"]).splitlines()):
            if len(line) > CODE_COLUMNS and re.search(r"\S {2,}\S", line):
                found.append((first + offset, len(line), line))
    return found


def test_long_output_rows_are_found():
    row = "  opt_state[0].mu['w']  (8, 32)  " + "P(None, 'model') -> P('data', 'model')  (dimension 0)" * 2
    text = (
        "```{.text .output}\n" + "a message of words " * 6 + "\n" + row + "\n  short  row\n```\n"
        "```python\n" + row + "\n```\n"
    )
    assert _long_output_rows(text) == [(3, len(row), row)]


@pytest.mark.parametrize("page", sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")))
def test_output_rows_show_whole_at_1280px(page):
    """The zero_report shown on the Sharding page once wrapped mid-row at 1280 px."""
    long = _long_output_rows((DOCS / page).read_text())
    assert not long, f"docs/{page}: rows of program output wider than the column, wrapped mid-row: {long}"


def shown_outputs(text: str) -> list[tuple[int, str]]:
    """``(n, output)`` of each output block right after a ```python block: the ``n``-th of ``python_blocks``."""
    found: list[tuple[int, str]] = []
    n, end_of_python = -1, None
    for match in FENCE.finditer(text):
        info = match["info"].strip().split()
        if info and info[0] in ("python", "{.python"):
            n, end_of_python = n + 1, match.end()
        elif re.search(r"\.output\b", match["info"]) and end_of_python is not None:
            if not text[end_of_python : match.start()].strip():
                found.append((n, textwrap.dedent(match["body"])))
            end_of_python = None
        else:
            end_of_python = None
    return found


def test_shown_outputs_are_found():
    text = (
        "```python\nprint(1)\n```\n```{.text .output}\n1\n```\n"
        "```python\nx = 2\n```\nprose\n```{.text .output}\nnot printed by x = 2\n```\n"
        "```py\nprint(3)\n```\n```{.text .output}\n3\n```\n"
    )
    assert shown_outputs(text) == [(0, "1\n")]


@pytest.mark.slow  # runs the page up to the block: the slow tier (-m slow) runs the pages
@pytest.mark.parametrize(
    "page", sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if shown_outputs(p.read_text()))
)
def test_shown_output_is_what_the_code_prints(page, tmp_path):
    """An output block right after a ```python block is what that block prints, run as the page runs."""
    text = (DOCS / page).read_text()
    blocks, shown = python_blocks(text), dict(shown_outputs(text))
    program: list[tuple[int, str]] = []
    for n, block in enumerate(blocks[: max(shown) + 1]):
        marked = n in shown
        program += [(1, f"print('<<{n}>>')")] * marked + [block] + [(1, f"print('<</{n}>>')")] * marked
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(
        [sys.executable, "-c", _PASTED, json.dumps([f"docs/{page}", "docs_page", program])],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"docs/{page}:\n{done.stderr[-4000:]}"
    for n, output in shown.items():
        printed = done.stdout.split(f"<<{n}>>\n", 1)[1].split(f"<</{n}>>\n", 1)[0]
        assert printed.rstrip() == output.rstrip(), f"docs/{page}: block {n} prints\n{printed}\nnot\n{output}"


def test_notebook_section_headings_have_no_inline_code():
    """The notebook pages' table of contents drops inline code from headings ("Labels and")."""
    found = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "markdown":
                continue
            for line in "".join(cell["source"]).splitlines():
                if re.match(r"#{2,6} ", line) and "`" in line:
                    found.append(f"{path.name}: {line}")
    assert not found, f"notebook headings with inline code: {found}"


def test_notebook_pages_take_their_titles_from_the_nav():
    """Their H1 titles hold inline code, which mkdocs-jupyter would strip from <title> and the nav."""
    jupyter = next(p for p in _config()["plugins"] if isinstance(p, dict) and "mkdocs-jupyter" in p)
    assert jupyter["mkdocs-jupyter"].get("ignore_h1_titles") is True
