"""A griffe extension for the API reference: treeopt's docstrings, rendered as Markdown.

- treeopt heads its doctests ``Example:``. Griffe's Google-style parser knows
  only the plural ``Examples:`` as an examples section (it reads the singular
  as an admonition, and ``>>>`` lines would render as prose), so such headers
  are renamed.
- Sphinx cross-reference roles (``:func:`save```, ``:class:`~treeopt.Optimizer```)
  become inline code, showing the last component where the target starts with ``~``.
- reST literal blocks (a paragraph ending in ``::``, then an indented block)
  become fenced Python code after the paragraph ending in ``:`` (``::`` alone
  on its line, or after a space, is dropped, as reST drops it): Markdown would
  show the ``::``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE_HEADER = re.compile(r"^(?P<indent>[ \t]*)Example:[ \t]*$", re.M)
_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|obj|data|exc|const):`(?P<target>[^`]+)`")


def literal_blocks_to_fences(text: str) -> str:
    """reST's ``Paragraph::`` and the indented block after it, as ``Paragraph:`` and a fenced block."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.rstrip()
        if not stripped.endswith("::"):
            out.append(line)
            i += 1
            continue
        indent = len(line) - len(line.lstrip())
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        body_start = j
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > indent):
            j += 1
        while j > body_start and not lines[j - 1].strip():
            j -= 1
        if body_start == j:  # no indented block follows: not a literal block
            out.append(line)
            i += 1
            continue
        head = stripped[:-2]
        if head.strip():  # "Paragraph::" reads "Paragraph:", "Paragraph ::" reads "Paragraph"
            out += [head.rstrip() if head.endswith(" ") else head + ":", ""]
        body = [text_line[indent:] if text_line.strip() else "" for text_line in lines[body_start:j]]
        common = min(len(b) - len(b.lstrip()) for b in body if b.strip())
        pad = " " * indent
        out += [pad + "```python", *[(pad + b[common:]) if b.strip() else "" for b in body], pad + "```"]
        i = j
    return "\n".join(out)


def _role_to_code(match: re.Match[str]) -> str:
    target = match["target"]
    if target.startswith("~"):
        target = target[1:].rsplit(".", 1)[-1]
    return f"`{target}`"


class TreeoptDocstrings(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is None:
            return
        value = _EXAMPLE_HEADER.sub(r"\g<indent>Examples:", docstring.value)
        docstring.value = literal_blocks_to_fences(_ROLE.sub(_role_to_code, value))
