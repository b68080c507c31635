"""The public surface is honest, and the package keeps the shape that makes it easy to read.

- Every public module's ``__all__`` names exist, and the building blocks the
  layers above the core need are in ``treeopt.internal``, not in a public
  ``__all__``.
- Names that moved still import from their old home, with a
  ``DeprecationWarning`` naming the new one.
- The layers built on the core (``treeopt.t5x``, ``treeopt.nnx``) import from
  the core only public ``__all__`` names or ``treeopt.internal``.
- No module of ``treeopt`` reaches into another object's private members;
  no module is over 600 lines, no function over 80.
- The private names of optax, JAX and flax (private modules, private
  members) appear only in their homes in ``treeopt/_compat/``.
"""

from __future__ import annotations

import ast
import importlib
import re
import warnings
from pathlib import Path

import pytest

import treeopt

PACKAGE = Path(treeopt.__file__).parent

PUBLIC = {
    "treeopt": None,
    "treeopt.serialization": None,
    "treeopt.checkpoint": None,
    "treeopt.errors": None,
    "treeopt.keys": None,
    "treeopt.step": None,
    "treeopt.typing": None,
    "treeopt.partitioning": None,
    "treeopt.hyperparams": None,
    "treeopt.masks": None,
    "treeopt.layout": None,
    "treeopt.optimizer": None,
}

INTERNAL_ONLY = {
    "derive_spec",
    "per_dimension_axes",
    "spec_leaves_with_names",
    "is_spec",
    "zero_leaf_spec",
    "ZeroLeafSpec",
    "checked_value",
    "path_to_name",
}

MOVED = [
    ("treeopt.partitioning", "derive_spec", "treeopt.internal"),
    ("treeopt.partitioning", "per_dimension_axes", "treeopt.internal"),
    ("treeopt.partitioning", "spec_leaves_with_names", "treeopt.internal"),
    ("treeopt.partitioning", "zero_leaf_spec", "treeopt.internal"),
    ("treeopt.partitioning", "ZeroLeafSpec", "treeopt.internal"),
    ("treeopt.serialization", "save", "treeopt.checkpoint"),
    ("treeopt.serialization", "restore", "treeopt.checkpoint"),
    ("treeopt.serialization", "restore_state_dict", "treeopt.checkpoint"),
    ("treeopt.serialization", "CheckpointManager", "treeopt.checkpoint"),
    ("treeopt.serialization", "CheckpointError", "treeopt.errors"),
    ("treeopt.checkpoint", "CheckpointError", "treeopt.errors"),
    ("treeopt.optimizer", "FlatStep", "treeopt.step"),
]


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_name_in_a_public_all_exists_and_none_is_internal(name):
    module = importlib.import_module(name)
    assert module.__all__, f"{name} has no __all__"
    for exported in module.__all__:
        assert hasattr(module, exported), f"{name}.__all__ lists {exported!r}, which it does not define"
    assert not INTERNAL_ONLY & set(module.__all__)


def test_the_internal_module_holds_the_building_blocks():
    internal = importlib.import_module("treeopt.internal")
    assert set(internal.__all__) >= INTERNAL_ONLY
    for name in internal.__all__:
        assert hasattr(internal, name)


@pytest.mark.parametrize(("old_home", "name", "new_home"), MOVED)
def test_a_moved_name_still_imports_with_a_deprecation_warning(old_home, name, new_home):
    with pytest.warns(DeprecationWarning, match=rf"{old_home}\.{name} moved: import it from {new_home}\."):
        old = getattr(importlib.import_module(old_home), name)
    assert old is getattr(importlib.import_module(new_home), name)


def test_an_unknown_name_is_still_an_attribute_error():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
            _ = treeopt.partitioning.nonexistent  # type: ignore[attr-defined]


# -- the shape of the package --------------------------------------------------------------------


def _modules(under: Path = PACKAGE) -> list[Path]:
    return sorted(under.rglob("*.py"))


def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_the_layers_above_import_only_public_names_or_the_internal_module():
    offending = []
    for path in [*_modules(PACKAGE / "t5x"), PACKAGE / "nnx.py"]:
        for node in ast.walk(_parsed(path)):
            if (
                not isinstance(node, ast.ImportFrom)
                or not node.module
                or not node.module.startswith("treeopt")
            ):
                continue
            if node.module.startswith("treeopt.t5x") or node.module == "treeopt.internal":
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if alias.name not in getattr(module, "__all__", ()) and not (
                    node.module == "treeopt" and alias.name in {"internal"}
                ):
                    offending.append(f"{path.name}: from {node.module} import {alias.name}")
    assert not offending


def test_no_module_reaches_into_another_objects_private_members():
    offending = []
    for path in _modules():
        tree = _parsed(path)
        own_classes = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                continue
            base = node.value
            owner = base.id if isinstance(base, ast.Name) else None
            if owner in {"self", "cls"} | own_classes or node.attr in {"_replace", "_fields", "_asdict"}:
                continue  # its own members, or the public API of a NamedTuple
            offending.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {ast.unparse(node)}")
    assert not offending


def test_modules_and_functions_stay_small():
    too_long = []
    for path in _modules():
        source = path.read_text()
        if len(source.splitlines()) > 600:
            too_long.append(f"{path.relative_to(PACKAGE)}: {len(source.splitlines())} lines")
        for node in ast.walk(_parsed(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if length > 80:
                    too_long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {length} lines")
    assert not too_long


# -- the wings -------------------------------------------------------------------------------------

WINGS = ("_compat", "_tree", "_sharding", "_lowbit", "_step", "_state", "_update", "_optimizer", "_checkpoint")
# What each wing may import of treeopt, besides itself and the foundations every layer uses.
FOUNDATIONS = {"treeopt.errors", "treeopt.typing"}
MAY_IMPORT = {
    "_compat": set(),
    "_tree": {"_compat"},
    "_sharding": {"_compat", "_tree"},
    "_lowbit": {"_compat", "_tree", "_sharding"},
    "_step": {"_compat", "_tree", "_sharding", "_lowbit"},
    "_state": {"_compat", "_tree", "_sharding", "_lowbit"},
    "_update": {"_compat", "_tree", "_sharding", "_step"},
    "_optimizer": {"_compat", "_tree", "_sharding", "_lowbit", "_step", "_state", "_update"},
    "_checkpoint": {"_compat", "_tree", "_state", "_sharding", "_optimizer"},
}
# Public modules a wing may import besides the foundations: the optimizer reads hyperparameters.
MAY_IMPORT_FACES = {"_optimizer": {"treeopt.hyperparams"}}
# The libraries whose private names (a module or member whose name starts with "_") treeopt may read: each
# library's only in its home, treeopt/_compat/<library>_private.py. jaxlib, JAX's compiled half, is private
# whole, and its home is JAX's.
PRIVATE_LIBRARIES = ("jax", "jaxlib", "optax", "flax")
COMPAT = PACKAGE / "_compat"
# The homes there are: of JAX's private APIs, and of optax's private names (read by name, never reached into).
PRIVATE_HOMES = set(COMPAT.glob("*_private.py"))


def _treeopt_imports(path: Path) -> list[str]:
    """The treeopt modules ``path`` imports (``from treeopt import x`` counts as ``treeopt.x``)."""
    found = []
    for node in ast.walk(_parsed(path)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] == "treeopt"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "treeopt":
            if node.module == "treeopt":
                found += [f"treeopt.{alias.name}" for alias in node.names]
            else:
                found.append(node.module)
    return found


def test_the_top_of_the_package_holds_public_faces_only():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= 14, top
    assert not [name for name in top if name.startswith("_") and name != "__init__.py"]
    wings = sorted(
        path.name
        for path in PACKAGE.iterdir()
        if path.is_dir() and path.name.startswith("_") and path.name != "__pycache__"
    )
    assert wings == sorted(WINGS)


@pytest.mark.parametrize("wing", WINGS)
def test_each_wing_says_what_it_is_for_and_imports_only_what_it_may(wing):
    modules = [path for path in (PACKAGE / wing).glob("*.py") if path.name != "__init__.py"]
    assert len(modules) >= 2
    doc = ast.get_docstring(_parsed(PACKAGE / wing / "__init__.py"))
    assert doc and "May import" in doc
    allowed = {f"treeopt.{w}" for w in MAY_IMPORT[wing] | {wing}} | FOUNDATIONS | MAY_IMPORT_FACES.get(wing, set())
    offending = [
        f"{path.name}: {module}"
        for path in modules
        for module in _treeopt_imports(path)
        if not any(module == a or module.startswith(a + ".") for a in allowed)
    ]
    assert not offending


def test_no_module_below_the_faces_imports_the_package_face_or_the_optimizer():
    below = [path for wing in WINGS for path in (PACKAGE / wing).glob("*.py")]
    below += [PACKAGE / name for name in ("step.py", "hyperparams.py", "errors.py", "keys.py", "typing.py")]
    offending = [
        f"{path.relative_to(PACKAGE)}: {module}"
        for path in below
        for module in _treeopt_imports(path)
        if module in {"treeopt", "treeopt.optimizer"}
        or module.startswith("treeopt.t5x")
        or module == "treeopt.nnx"
    ]
    assert not offending


def _private_home(library: str) -> Path:
    return COMPAT / f"{'jax' if library == 'jaxlib' else library}_private.py"


_DOTTED_NAME = re.compile(rf"(?<![\w.])(?:{'|'.join(PRIVATE_LIBRARIES)})(?:\.\w+)+")


def _is_private(name: str) -> bool:
    """Whether a dotted name is private to its library: one of its segments starts with "_" (a dunder such as
    ``__version__`` is public), or it is jaxlib's."""
    top, *segments = name.split(".")
    return top in PRIVATE_LIBRARIES and (
        top == "jaxlib"
        or any(s.startswith("_") and not (s.startswith("__") and s.endswith("__")) for s in segments)
    )


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for an attribute chain off a name, else ``None``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _private_names(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, name)`` of each private name of :data:`PRIVATE_LIBRARIES` that ``tree`` imports, names in a
    string (a docstring, a module path for importlib) or reaches as an attribute (``optax._src.alias``)."""
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = _DOTTED_NAME.findall(node.value)
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            names = [name] if (name := _dotted(node)) is not None else []
        found += [(node.lineno, name) for name in names if _is_private(name)]
    return found


def test_other_libraries_private_names_live_in_their_homes_in_compat():
    """A private module of optax, JAX or flax (``optax._src.transform``, ``jax._src.core``, any of jaxlib) is
    imported or named only in its library's home in treeopt/_compat/, so a release that moves it breaks one
    file, whose tests (tests/project/test_private_names.py) say which name moved."""
    offending = [
        f"{path.relative_to(PACKAGE)}:{line} {name}"
        for path in _modules()
        for line, name in _private_names(_parsed(path))
        if path != _private_home(name.split(".")[0])
    ]
    assert not offending


def test_the_private_name_rule_finds_each_way_of_naming_one():
    source = """
import jaxlib.xla_client
from jax._src import core
from optax.contrib import _muon
import optax, flax
TABLE = {("optax._src.transform", "ScaleByRmsWithCountState"): 1}
LINES = "optax.contrib._ademamix ScaleBySimplifiedAdEMAMixState m: ..."
alias = optax._src.alias
layer = flax.nnx._private_member
public = ("optax.contrib", "jax.numpy", flax.__version__, "treeopt._compat.optax_private", "jax.__version__")
"""
    assert {name for _, name in _private_names(ast.parse(source))} == {
        "jaxlib.xla_client",
        "jax._src",
        "jax._src.core",
        "optax.contrib._muon",
        "optax._src.transform",
        "optax.contrib._ademamix",
        "optax._src",
        "flax.nnx._private_member",
    }


def test_no_getattr_reaches_a_private_member():
    offending = []
    for path in _modules():
        if path in PRIVATE_HOMES:
            continue
        for node in ast.walk(_parsed(path)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in {"getattr", "hasattr", "setattr"}
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and node.args[1].value.startswith("_")
                and not node.args[1].value.startswith("__")
                and node.args[1].value not in {"_fields", "_replace", "_asdict"}  # a NamedTuple's public API
                and not (isinstance(node.args[0], ast.Name) and node.args[0].id in {"self", "cls"})
            ):
                offending.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {ast.unparse(node)}")
    assert not offending


def test_flax_nnx_is_imported_by_at_most_two_core_modules():
    core = [path for path in _modules() if path.name != "nnx.py" and "t5x" not in path.parts]
    importing = []
    for path in core:
        for node in ast.walk(_parsed(path)):
            if isinstance(node, ast.Import) and any(a.name.startswith("flax.nnx") for a in node.names):
                importing.append(path.name)
            elif (
                isinstance(node, ast.ImportFrom)
                and node.module
                and (
                    node.module.startswith("flax.nnx")
                    or (node.module == "flax" and any(a.name == "nnx" for a in node.names))
                )
            ):
                importing.append(path.name)
    assert len(set(importing)) <= 2, sorted(set(importing))


# Hand-written pytree registrations, which one style (fields declared once) replaces outside the T5X mirror.
_HAND_WRITTEN = {
    "register_pytree_node",
    "register_pytree_node_class",
    "register_pytree_with_keys",
    "register_pytree_with_keys_class",
}


def test_pytree_fields_are_declared_once_outside_the_t5x_mirror():
    offending = []
    for path in _modules():
        if "t5x" in path.relative_to(PACKAGE).parts:
            continue
        for node in ast.walk(_parsed(path)):
            called = node.func if isinstance(node, ast.Call) else None
            name = called.attr if isinstance(called, ast.Attribute) else getattr(called, "id", None)
            decorated = isinstance(node, ast.ClassDef) and any(
                (d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", None)) in _HAND_WRITTEN
                for d in node.decorator_list
            )
            methods = isinstance(node, ast.FunctionDef) and node.name.lstrip("_").startswith(
                ("tree_flatten", "tree_unflatten")
            )
            if name in _HAND_WRITTEN or decorated or methods:
                offending.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not offending


def test_the_nnx_drop_in_imports_the_core_optimizer_module_not_the_package_face():
    imported = _treeopt_imports(PACKAGE / "nnx.py")
    assert "treeopt.optimizer" in imported and "treeopt" not in imported
    tree = _parsed(PACKAGE / "nnx.py")
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import) and any(a.name == "treeopt" for a in n.names)]
