"""The architecture's rules that keep a new state child cheap: declared once, one low-bit face, a small optimizer.

- Every child of the optimizer's state is declared once
  (``treeopt._tree.children``): the optimizer's leaves, the state dict's
  entries, the precisions' states and their views read the declarations, and
  no other module spells a precision child's name.
- ``treeopt._lowbit`` has one face: no module outside it imports one of its modules.
- ``treeopt/_optimizer/optimizer.py`` keeps the optimizer's face and its pytree nature.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import treeopt
from treeopt._optimizer.parts import state_parts, with_state_parts
from treeopt._sharding.zero import KEPT_WHOLE, zero_plan
from treeopt._state.state_dict import StateParts
from treeopt._step.precision import ROUNDINGS, AsIs, MasterWeights
from treeopt._tree import children
from treeopt._tree.children import CHILDREN, EMA, MASTER, OPT_STATE, PRECISION_CHILDREN, STEP, VIEWS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "treeopt"

PRECISIONS = {
    "as is": {},
    "master weights": {"master_dtype": jnp.float32},
    "kahan": {"param_rounding": "kahan"},
    "stochastic": {"param_rounding": "stochastic"},
}


def _params():
    return {"dense": {"kernel": jnp.ones((4, 8), jnp.bfloat16), "bias": jnp.zeros(8, jnp.bfloat16)}}


def _strings_outside_docstrings(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    }


# -- state children, declared once ----------------------------------------------------------------


@pytest.mark.parametrize("ema", [None, 0.99])
@pytest.mark.parametrize("name", sorted(PRECISIONS))
def test_the_state_dict_holds_the_declared_children_and_nothing_else(name, ema):
    opt = treeopt.Optimizer(optax.adam(1e-3), ema=ema, **PRECISIONS[name]).init(_params())
    declared = [STEP.name, OPT_STATE.name, *(child.name for child in opt.precision.children)]
    declared += [EMA.name] if ema is not None else []
    assert list(opt.state_dict()) == declared
    assert set(declared) <= {child.name for child in CHILDREN}


@pytest.mark.parametrize("precision", [AsIs(), MasterWeights(np.dtype("float32")), *(r() for r in ROUNDINGS.values())])
def test_each_precision_state_holds_exactly_its_declared_children(precision):
    _, state = precision.init({"w": jnp.ones(3, jnp.bfloat16)})
    leaves = [field.name for field in dataclasses.fields(state) if not field.metadata.get("static")]
    assert leaves == [child.attribute for child in precision.children]
    assert set(precision.children) <= set(PRECISION_CHILDREN)
    views = precision.views(state)
    assert list(views) == list(VIEWS)
    for child in precision.children:  # each child shown in its declared view, under its declared key
        shown = views[child.view] if child.shown_under is None else views[child.view][child.shown_under]
        assert jax.tree.structure(shown) == jax.tree.structure(getattr(state, child.attribute))


def test_the_optimizer_holds_the_leaves_of_the_parts_under_their_names():
    opt = treeopt.Optimizer(optax.adam(1e-3), master_dtype=jnp.float32, ema=0.9).init(_params())
    paths = jax.tree_util.tree_flatten_with_path(opt)[0]
    names = [path[0].name for path, _ in paths]
    assert list(dict.fromkeys(names)) == list(StateParts.leaf_fields())
    assert opt.master["dense/kernel"] is dict(paths)[(jax.tree_util.GetAttrKey("precision_state"),
        jax.tree_util.GetAttrKey("master"), jax.tree_util.DictKey("dense/kernel"))]


def test_parts_are_rebuilt_by_name_not_by_leaf_order():
    opt = treeopt.Optimizer(optax.adam(1e-3), param_rounding="kahan").init(_params())
    parts = state_parts(opt)
    # A child the optimizer did not hold lands under its name: rebuilding by leaf order would not fit.
    averaged = dataclasses.replace(parts, step=jnp.int32(7), ema_state={"dense/kernel": jnp.zeros((4, 8))})
    rebuilt = with_state_parts(opt, averaged)
    assert int(rebuilt.step) == 7 and rebuilt.opt_state is parts.opt_state
    assert list(rebuilt.ema) == ["dense/kernel"] and rebuilt.rounding["compensation"] is not None
    specs = opt.partition_specs(jax.tree.map(lambda _: P(), _params()))
    assert specs.step == P()
    assert specs.rounding["compensation"]["dense/kernel"] == P()
    assert specs.opt_state[0].mu["dense/bias"] == P()


def test_a_part_whose_child_is_declared_unsplit_keeps_its_spec_under_zero():
    opt = treeopt.Optimizer(optax.sgd(0.1, momentum=0.9), master_dtype=jnp.float32).init(_params())
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1), ("data",))
    parts = state_parts(opt).by_part()
    specs = {"dense/kernel": P(), "dense/bias": P()}
    _, report = zero_plan(parts, opt.layout, specs, "data", mesh)
    assert {leaf.path: leaf.dim for leaf in report.leaves}["master['dense/kernel']"] == 1
    _, report = zero_plan(parts, opt.layout, specs, "data", mesh, unsplit=frozenset({MASTER.view}))
    kept = {leaf.path: leaf.reason for leaf in report.leaves if leaf.path.startswith("master")}
    assert kept == {"master['dense/bias']": KEPT_WHOLE, "master['dense/kernel']": KEPT_WHOLE}
    # Today every child that belongs to parameters is split, and the rounding key never is.
    assert state_parts(opt).unsplit_parts() == frozenset()
    stochastic = treeopt.Optimizer(optax.sgd(0.1), param_rounding="stochastic").init(_params())
    assert state_parts(stochastic).unsplit_parts() == frozenset({"rounding"})


def test_no_module_but_the_declarations_spells_a_precision_childs_name():
    spelled = {name for child in PRECISION_CHILDREN for name in (child.name, child.view)}
    home = Path(children.__file__)
    offending = sorted(
        f"{path.relative_to(ROOT)}: {sorted(found)}"
        for path in PACKAGE.rglob("*.py")
        if path != home and (found := _strings_outside_docstrings(path) & spelled)
    )
    assert not offending


# -- one low-bit face ------------------------------------------------------------------------------


def _imported_modules(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
            if node.module == "treeopt._lowbit":
                found += [f"treeopt._lowbit.{alias.name}" for alias in node.names if alias.name.islower()]
    return found


def test_no_module_outside_the_low_bit_wing_imports_one_of_its_modules():
    wing = PACKAGE / "_lowbit"
    modules = {path.stem for path in wing.glob("*.py") if path.name != "__init__.py"}
    sources = [*PACKAGE.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "examples").rglob("*.py")]
    sources += [path for path in (ROOT / "tests").rglob("*.py") if "lowbit" not in path.relative_to(ROOT).parts]
    offending = sorted(
        f"{path.relative_to(ROOT)}: {module}"
        for path in sources
        if wing not in path.parents
        for module in _imported_modules(path)
        if module.startswith("treeopt._lowbit.") and module.split(".")[2] in modules
    )
    assert not offending


def test_the_low_bit_face_exports_what_the_other_wings_use():
    import treeopt._lowbit as lowbit

    exported = {name for name in vars(lowbit) if not name.startswith("_") and callable(getattr(lowbit, name))}
    assert {"quantized_state", "decoded", "encoded_after_step", "in_target_form", "is_quantized"} <= exported


# -- the optimizer's module --------------------------------------------------------------------------


def test_the_optimizer_module_keeps_its_face_and_pytree_nature_only():
    source = (PACKAGE / "_optimizer" / "optimizer.py").read_text()
    assert len(source.splitlines()) <= 450
    tree = ast.parse(source)
    (cls,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Optimizer"]
    methods = {node.name for node in cls.body if isinstance(node, ast.FunctionDef)}
    assert not methods & {"hyperparams", "set_hyperparams", "partition_specs", "master", "rounding"}
    assert {"init", "update", "state_dict", "load_state_dict"} <= methods
