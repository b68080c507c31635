"""A griffe extension for the API reference: treeopt's docstrings, rendered as Markdown.

- treeopt heads its doctests ``Example:``. Griffe's Google-style parser knows
  only the plural ``Examples:`` as an examples section (it reads the singular
  as an admonition, and ``>>>`` lines would render as prose), so such headers
  are renamed.
- Sphinx cross-reference roles (``:func:`save```, ``:class:`~treeopt.Optimizer```)
  become inline code, showing the last component where the target starts with ``~``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE_HEADER = re.compile(r"^(?P<indent>[ \t]*)Example:[ \t]*$", re.M)
_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|obj|data|exc|const):`(?P<target>[^`]+)`")


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
        docstring.value = _ROLE.sub(_role_to_code, value)
