"""Each private name of JAX and optax that treeopt reads is still where treeopt reads it.

treeopt reads other libraries' private names only in their homes in
``treeopt/_compat/`` (tests/project/test_public_surface.py holds that rule).
Each function there falls back to a safe answer, or raises, when the library
moves the name; these tests ask each for the real thing, so the release that
moves one fails here, naming it, rather than degrading treeopt quietly.
:data:`GUARDS` lists every private name the homes hold with the test that
guards it, and a test checks that the list is complete.

Every name here exists at the declared lower bounds (JAX 0.7.1, optax 0.2.7)
as at the current releases: none is expected to fall back.
"""

from __future__ import annotations

import ast
import importlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_public_surface import PRIVATE_HOMES, _parsed, _private_names

import treeopt._lowbit as statistics
from treeopt._compat.jax_private import (
    abstract_key_impl,
    current_trace,
    eager_or_autodiff,
    trace_of,
    weakly_typed,
)
from treeopt._compat.optax_private import (
    OPTAX_ALIAS,
    OPTAX_STATE_MODULES,
    OPTAX_WHOLE_LEAF,
    is_optax_alias,
    multi_steps_parts,
)

# Every private name of another library in treeopt/_compat/ (a module path, or a private attribute read by
# name), with the test of this file that fails when the library moves it.
GUARDS = {
    "jax_private.py": {
        "jax._src": "test_current_trace_is_the_innermost_trace",
        "jax._src.core": "test_current_trace_is_the_innermost_trace",
        "_trace": "test_trace_of_is_the_trace_a_tracer_belongs_to",
        "jax._src.lax.lax": "test_weakly_typed_makes_a_weakly_typed_array",
        "jax._src.lax.lax._convert_element_type": "test_weakly_typed_makes_a_weakly_typed_array",
        "_impl": "test_abstract_key_impl_is_the_key_implementation_of_a_typed_key_dtype",
    },
    "optax_private.py": {
        "_opt": "test_multi_steps_parts_are_what_it_was_built_from",
        "_every_k_schedule": "test_multi_steps_parts_are_what_it_was_built_from",
        "_use_grad_mean": "test_multi_steps_parts_are_what_it_was_built_from",
        "_should_skip_update_fn": "test_multi_steps_parts_are_what_it_was_built_from",
        "optax.contrib._muon": "test_the_whole_leaf_functions_are_where_optax_calls_them",
        "optax._src.transform": "test_each_state_type_the_tables_name_in_a_private_module_is_there",
        "optax._src.factorized": "test_each_state_type_the_tables_name_in_a_private_module_is_there",
        "optax.contrib._ademamix": "test_each_state_type_the_tables_name_in_a_private_module_is_there",
        "optax._src.alias": "test_the_alias_module_holds_optaxs_optimizers",
    },
}


def _private_attributes(tree: ast.Module) -> set[str]:
    """The private attributes ``tree`` reads by name: ``getattr(x, "_name"...)``."""
    return {
        node.args[1].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
        and node.args[1].value.startswith("_")
        and not node.args[1].value.startswith("__")
    }


def test_every_private_name_in_compat_has_a_test_here():
    held = {}
    for home in sorted(PRIVATE_HOMES):
        tree = _parsed(home)
        held[home.name] = {name for _, name in _private_names(tree)} | _private_attributes(tree)
    expected = {home: set(names) for home, names in GUARDS.items()}
    assert held == expected, "add each new private name, with its test, to GUARDS"
    tests = {name for name, value in globals().items() if name.startswith("test_") and callable(value)}
    assert {test for names in GUARDS.values() for test in names.values()} <= tests


# -- JAX -------------------------------------------------------------------------------------------


def test_current_trace_is_the_innermost_trace():
    # Falls back to None where jax._src.core.trace_ctx.trace is gone.
    seen = {}

    @jax.jit
    def traced(x):
        seen["inside"] = current_trace()
        return x

    outside = current_trace()
    traced(1.0)
    assert outside is not None and seen["inside"] is not None
    assert seen["inside"] is not outside
    assert type(seen["inside"]).__name__ == "DynamicJaxprTrace"


def test_trace_of_is_the_trace_a_tracer_belongs_to():
    # Falls back to None where a tracer has no _trace.
    seen = {}

    def inner(x):
        seen["grad"] = (trace_of(x), current_trace())
        return x * x

    @jax.jit
    def traced(x):
        seen["jit"] = (trace_of(x), current_trace())
        return jax.grad(inner)(x)

    traced(1.0)
    for where, (own, innermost) in seen.items():
        assert own is not None and own is innermost, where
    assert seen["grad"][0] is not seen["jit"][0]
    assert trace_of(jnp.ones(2)) is None  # a concrete array belongs to no trace


def test_eager_and_eager_autodiff_traces_are_told_from_the_others():
    # Falls back to False (every trace refused) where JAX renames its trace classes: eager jax.grad over a
    # concrete optimizer would then be refused, so the names are checked against this JAX's traces.
    seen = {}

    def loss(x, where):
        seen[where] = eager_or_autodiff(current_trace())
        return x * x

    loss(1.0, "eager")
    jax.grad(loss)(1.0, "grad")
    jax.jvp(lambda x: loss(x, "jvp"), (1.0,), (1.0,))
    jax.linearize(lambda x: loss(x, "linearize"), 1.0)
    jax.jit(lambda x: loss(x, "jit"))(1.0)
    jax.vmap(lambda x: loss(x, "vmap"))(jnp.ones(2))
    assert seen == {"eager": True, "grad": True, "jvp": True, "linearize": True, "jit": False, "vmap": False}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_weakly_typed_makes_a_weakly_typed_array(dtype):
    # Falls back to the array as it is (strongly typed) where jax._src.lax.lax._convert_element_type is gone.
    x = jnp.ones(3, dtype)
    assert not x.weak_type
    weak = weakly_typed(x)
    assert weak.weak_type and weak.dtype == dtype
    np.testing.assert_array_equal(weak, x)
    abstract = jax.eval_shape(weakly_typed, x)
    assert abstract.weak_type and abstract.dtype == dtype


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_abstract_key_impl_is_the_key_implementation_of_a_typed_key_dtype(impl):
    # Falls back to None (the default implementation) where a key dtype has no _impl.
    key = jax.random.key(0, impl=impl)
    for dtype in (key.dtype, jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype):
        found = abstract_key_impl(dtype)
        assert found is not None
        rewrapped = jax.random.wrap_key_data(jax.random.key_data(key), impl=found)
        assert rewrapped.dtype == key.dtype
        np.testing.assert_array_equal(jax.random.key_data(rewrapped), jax.random.key_data(key))
    assert abstract_key_impl(np.dtype(np.float32)) is None  # not a key dtype


# -- optax -----------------------------------------------------------------------------------------


def test_multi_steps_parts_are_what_it_was_built_from():
    # No fallback: multi_steps_parts raises AttributeError, naming the attribute, where MultiSteps lacks one.
    inner = optax.sgd(0.1)

    def skip(updates, gradient_step, params):
        return jnp.array(False), ()

    multi = optax.MultiSteps(inner, every_k_schedule=3, use_grad_mean=False, should_skip_update_fn=skip)
    parts = multi_steps_parts(multi)
    assert parts.opt is inner  # optax.sgd supports extra args already: kept as it is
    assert parts.every_k_schedule(0) == 3
    assert parts.use_grad_mean is False
    assert parts.should_skip_update_fn is skip
    params = {"w": jnp.arange(4.0)}
    rebuilt = optax.MultiSteps(*parts)
    for a, b in zip(jax.tree.leaves(multi.init(params)), jax.tree.leaves(rebuilt.init(params)), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("entry", OPTAX_WHOLE_LEAF, ids=lambda e: f"{e['module']}.{e['name']}")
def test_the_whole_leaf_functions_are_where_optax_calls_them(entry, monkeypatch):
    # An optax without the function has it skipped at registration: Muon's matrices would no longer be owned.
    module = importlib.import_module(entry["module"])
    function = getattr(module, entry["name"])
    parameters = inspect.signature(function).parameters
    assert entry["leaf"] in parameters and entry["dimension_numbers"] in parameters
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    monkeypatch.setattr(module, entry["name"], counted)
    params = {"w": jnp.ones((4, 8))}
    tx = optax.contrib.muon(1e-2)
    tx.update(params, tx.init(params), params)
    assert calls, f"optax.contrib.muon no longer calls {entry['module']}.{entry['name']}"


def _private_state_types() -> list[tuple[str, str]]:
    named = {*statistics.STATISTICS, *((module, name) for module, name, _, _ in statistics.FULL_PRECISION)}
    return sorted((m, n) for m, n in named if any(s.startswith("_") for s in m.split(".")))


def test_each_state_type_the_tables_name_in_a_private_module_is_there():
    # The tables look types up by name and skip one that is not there: its fields would quietly keep full
    # precision (a statistic) or become codes (a copy of the params).
    private = _private_state_types()
    assert {module for module, _ in private} == set(OPTAX_STATE_MODULES)
    for module, name in private:
        cls = getattr(importlib.import_module(module), name, None)
        assert isinstance(cls, type) and hasattr(cls, "_fields"), f"{module}.{name}"
    # Each field the tables name is a field of its type.
    for (module, name), fields in statistics.STATISTICS.items():
        if (module, name) in private:
            assert set(fields) <= set(getattr(importlib.import_module(module), name)._fields), (module, name)
    for module, name, field, _ in statistics.FULL_PRECISION:
        if (module, name) in private:
            assert field in getattr(importlib.import_module(module), name)._fields, (module, name, field)


def test_the_alias_module_holds_optaxs_optimizers():
    # Where the module moved, the docs' table would lose every optax alias.
    module = importlib.import_module(OPTAX_ALIAS)
    for name in ("adam", "adamw", "sgd", "rmsprop", "lion", "adafactor"):
        assert getattr(module, name) is getattr(optax, name)
        assert is_optax_alias(getattr(optax, name))
    assert not is_optax_alias(optax.scale_by_adam) and not is_optax_alias(optax.chain)
    listed = {name for name, _ in statistics.transformations()}
    assert {"optax.adam", "optax.adamw", "optax.sgd", "optax.lion"} <= listed
