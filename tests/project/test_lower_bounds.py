"""The pins CI installs for its lower-bounds stage are read from pyproject.toml, one per dependency."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("lower_bounds", ROOT / ".ci" / "lower_bounds.py")
assert _spec is not None and _spec.loader is not None
lower_bounds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lower_bounds)


def test_every_runtime_dependency_is_pinned_at_its_declared_bound():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = lower_bounds.pins(ROOT / "pyproject.toml")
    assert len(pins) == len(declared)
    for requirement, pin in zip(declared, pins, strict=True):
        name, version = pin.split("==")
        assert requirement.replace(" ", "").startswith(f"{name}>={version}"), (requirement, pin)


def test_pins_keep_extras_out_and_read_only_the_lower_bound(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["orbax-checkpoint[x] >= 0.12.5, <1", "jax>=0.7.1"]\n')
    assert lower_bounds.pins(pyproject) == ["orbax-checkpoint==0.12.5", "jax==0.7.1"]


def test_a_dependency_without_a_lower_bound_stops_ci(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["jax>=0.7.1", "optax"]\n')
    with pytest.raises(SystemExit, match="'optax' declares no lower bound"):
        lower_bounds.pins(pyproject)
