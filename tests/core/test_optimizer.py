"""The Optimizer object itself: pytree structure, names, init, copies."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treeopt

PARAMS = {
    "encoder": {"layers_0": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}},
    "steps_seen": jnp.int32(0),
    "blocks": [jnp.ones(2), jnp.ones(2)],
}


def test_uninitialized_optimizer_is_a_pytree_with_no_leaves():
    opt = treeopt.Optimizer(optax.adam(1e-3))
    assert not opt.initialized
    assert jax.tree.leaves(opt) == []
    assert "initialized=False" in repr(opt)


def test_init_returns_a_new_optimizer_and_leaves_self_alone():
    opt = treeopt.Optimizer(optax.adam(1e-3))
    ready = opt.init(PARAMS)
    assert ready is not opt and ready.initialized and not opt.initialized
    assert int(ready.step) == 0 and ready.step.dtype == jnp.int32


def test_paths_name_the_float_leaves_only():
    opt = treeopt.Optimizer(optax.adam(1e-3)).init(PARAMS)
    assert opt.paths == ("blocks/0", "blocks/1", "encoder/layers_0/bias", "encoder/layers_0/kernel")


def test_state_is_keyed_by_name():
    opt = treeopt.Optimizer(optax.adam(1e-3)).init(PARAMS)
    adam_state = opt.opt_state[0]
    assert set(adam_state.mu) == set(opt.paths)
    assert adam_state.mu["encoder/layers_0/kernel"].shape == (2, 3)


def test_leaves_are_step_and_state_with_readable_key_paths():
    opt = treeopt.Optimizer(optax.sgd(0.1, momentum=0.9)).init(PARAMS)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(opt)[0]]
    assert paths[0] == ".step"
    assert any("encoder/layers_0/kernel" in p for p in paths)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(opt))


def test_equal_layouts_from_separate_inits_share_one_compilation():
    traces = 0

    @jax.jit
    def count(opt):
        nonlocal traces
        traces += 1
        return opt

    tx = optax.adam(1e-3)
    count(treeopt.Optimizer(tx).init(PARAMS))
    fresh = jax.tree.map(lambda x: x + 0, PARAMS)  # same layout, other arrays
    count(treeopt.Optimizer(tx).init(fresh))
    assert traces == 1
    assert jax.tree.structure(treeopt.Optimizer(tx).init(PARAMS)) == jax.tree.structure(
        treeopt.Optimizer(tx).init(fresh)
    )


def test_wrt_glob_freezes_unselected_float_leaves():
    opt = treeopt.Optimizer(optax.sgd(1.0), wrt="encoder/*").init(PARAMS)
    assert opt.paths == ("encoder/layers_0/bias", "encoder/layers_0/kernel")
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    new = opt.update(grads, PARAMS)
    np.testing.assert_array_equal(new["blocks"][0], PARAMS["blocks"][0])
    np.testing.assert_array_equal(new["encoder"]["layers_0"]["kernel"], 0.0)
    assert new["steps_seen"] is PARAMS["steps_seen"]


def test_wrt_callable_sees_name_and_leaf():
    seen = []

    def pick(name, leaf):
        seen.append(name)
        return name.startswith("blocks") and leaf.ndim == 1

    opt = treeopt.Optimizer(optax.sgd(1.0), wrt=pick).init(PARAMS)
    assert opt.paths == ("blocks/0", "blocks/1")
    assert "steps_seen" in seen


def test_copies_are_independent():
    opt = treeopt.Optimizer(optax.adam(1e-3)).init(PARAMS)
    shallow, deep = copy.copy(opt), copy.deepcopy(opt)
    shallow.update(jax.tree.map(jnp.ones_like, PARAMS), PARAMS)
    assert int(shallow.step) == 1 and int(opt.step) == 0 and int(deep.step) == 0
    assert deep.paths == opt.paths


def test_a_copy_keeps_the_precision_and_its_state():
    params = {"w": jnp.ones((3,), jnp.bfloat16)}
    opt = treeopt.Optimizer(optax.sgd(0.5), param_rounding="stochastic", rounding_seed=5).init(params)
    opt.update({"w": jnp.ones((3,), jnp.bfloat16)}, params)
    deep = copy.deepcopy(opt)
    assert deep.precision == opt.precision and int(deep.step) == 1 and deep.paths == opt.paths
    assert jax.tree.structure(deep) == jax.tree.structure(opt)
    np.testing.assert_array_equal(jax.random.key_data(deep.rounding["key"]), jax.random.key_data(opt.rounding["key"]))
    fresh = copy.deepcopy(treeopt.Optimizer(optax.sgd(0.5)))
    assert not fresh.initialized and jax.tree.leaves(fresh) == []


def test_the_fields_jax_rebuilds_an_optimizer_from_are_no_options():
    with pytest.raises(TypeError, match="unexpected keyword argument 'step'"):
        treeopt.Optimizer(optax.sgd(0.5), step=jnp.int32(3))


def test_repr_shows_transformation_step_and_size():
    opt = treeopt.Optimizer(optax.adamw(1e-3)).init(PARAMS)
    assert repr(opt) == "Optimizer(tx=chain, step=0, params=4)"


def test_flat_step_is_the_pure_step_update_runs_on():
    from treeopt.step import flat_step

    tx = optax.adam(0.1)
    params = {"a/b": jnp.array([1.0, 2.0]), "c": jnp.array(3.0)}
    grads = {"a/b": jnp.array([0.5, -1.0]), "c": jnp.array(2.0)}
    state = tx.init(params)
    out = flat_step(tx, jnp.int32(4), state, grads, params)
    updates, want_state = tx.update(grads, state, params)
    assert int(out.step) == 5
    # Compiled as one program, so equal to op-by-op optax up to float rounding.
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6)  # noqa: E731
    jax.tree.map(close, out.output, optax.apply_updates(params, updates))
    jax.tree.map(close, out.opt_state, want_state)
    # Pure: its inputs are untouched, and the updates instead of params on request.
    jax.tree.map(np.testing.assert_array_equal, state, tx.init(params))
    only_updates = flat_step(tx, jnp.int32(0), state, grads, params, apply_updates=False).output
    jax.tree.map(close, only_updates, updates)
    # Traced inline under jit, the same numbers.
    traced = jax.jit(lambda s, st: flat_step(tx, s, st, grads, params))(jnp.int32(4), state)
    jax.tree.map(np.testing.assert_array_equal, traced.output, out.output)


def _counting(tx):
    """``tx`` with a counter of how often its update is traced (Python runs only while tracing)."""
    counter = {"traces": 0}

    def update(updates, state, params=None, **extra):
        counter["traces"] += 1
        return tx.update(updates, state, params, **extra)

    return optax.GradientTransformationExtraArgs(tx.init, update), counter


def test_weakly_typed_params_compile_the_eager_step_once():
    tx, counter = _counting(optax.adam(1e-2))
    params = {"w": jnp.full((3,), 0.01), "b": jnp.full((2,), 0.5)}
    assert all(x.weak_type for x in jax.tree.leaves(params))
    opt = treeopt.Optimizer(tx).init(params)
    assert counter["traces"] == 0
    for _ in range(5):
        grads = {"w": jnp.full((3,), 0.1), "b": jnp.full((2,), 0.2)}  # weak every step
        params = opt.update(grads, params)
    assert counter["traces"] == 1
    assert int(opt.step) == 5
    assert not any(getattr(x, "weak_type", False) for x in jax.tree.leaves(opt))
    assert not any(x.weak_type for x in jax.tree.leaves(params))

    # The same program for strongly typed inputs of that layout, and for updates only.
    strong = {"w": jnp.ones(3, jnp.float32), "b": jnp.ones(2, jnp.float32)}
    opt.update(strong, strong)
    assert counter["traces"] == 1
    weak = {"w": jnp.full((3,), 0.01), "b": jnp.full((2,), 0.5)}
    for _ in range(3):
        opt.update(weak, weak, apply_updates=False)
    assert counter["traces"] == 2  # one more program: it returns updates, not params


def test_updates_are_zero_at_float_leaves_that_are_not_trained():
    """``apply_updates=False`` returns updates shaped like the grads: zeros where nothing is trained."""
    params = {"w": jnp.ones(2), "frozen": jnp.ones(3), "n": jnp.int32(4)}
    opt = treeopt.Optimizer(optax.sgd(0.5), wrt="w").init(params)
    grads = {"w": jnp.ones(2), "frozen": jnp.full(3, 7.0), "n": jnp.int32(4)}
    updates = opt.update(grads, apply_updates=False)
    np.testing.assert_array_equal(updates["w"], -0.5 * np.ones(2))
    np.testing.assert_array_equal(updates["frozen"], np.zeros(3))
    assert int(updates["n"]) == 4
