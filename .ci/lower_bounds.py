"""Prints ``name==version`` for each direct runtime dependency of pyproject.toml, at its lower bound.

CI installs these pins into a fresh environment and runs the tests there, so
the bounds the package declares are bounds it has passed at. Every direct
dependency must declare one (``name>=version``).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

LOWER_BOUND = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*>=\s*([^,;\s]+)")


def pins(pyproject: Path) -> list[str]:
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    found = []
    for requirement in dependencies:
        match = LOWER_BOUND.match(requirement)
        if match is None:
            sys.exit(f"pyproject.toml: {requirement!r} declares no lower bound (name>=version)")
        found.append(f"{match[1]}=={match[2]}")
    return found


if __name__ == "__main__":
    print(" ".join(pins(Path(__file__).resolve().parent.parent / "pyproject.toml")))
