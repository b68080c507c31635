"""Extra arguments of ``update`` (``value``, ``grad``, ``value_fn``) in the user's structure.

optax's L-BFGS calls ``value_fn(params)`` from its zoom line search and reads
``grad`` leaf by leaf beside the gradients, so both must reach it in the
structure of the flat, named params the state is kept over, while the user
writes them for nested params. Checked against raw optax on nested params:

- under ``jax.jit``: bit for bit (the same program up to the container of the
  params; the leaves come in the same order);
- eagerly: treeopt runs its own compiled update, not the user's whole step,
  so float32 rounding differs from raw optax under jit (the reference, as op by
  op L-BFGS takes seconds a step): ``rtol=1e-5, atol=1e-6`` (``EAGER_TOL``) on
  the objective values and params.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import treeopt
from treeopt.step import flat_step

import _helpers
from _helpers import assert_trees_equal

EAGER_TOL = {"rtol": 1e-5, "atol": 1e-6}

PARAMS = {
    "encoder": {"w": jnp.array([[0.5, -1.0], [1.5, 0.2]]), "b": jnp.array([0.1, -0.3])},
    "head": [jnp.array([1.0, 2.0]), jnp.float32(0.5)],
}


def objective(params):
    h = jnp.tanh(params["encoder"]["w"] @ jnp.array([1.0, -2.0]) + params["encoder"]["b"])
    fit = jnp.sum((h * params["head"][0] - jnp.array([0.3, -0.7])) ** 2)
    return fit + (params["head"][1] - 1.0) ** 2 + 0.1 * jnp.sum(params["encoder"]["w"] ** 4)


def run(step, params, state, steps, jit):
    """``steps`` calls of ``step(params, state) -> (params, state, value)``: the params and the values."""
    step = jax.jit(step) if jit else step
    values = []
    for _ in range(steps):
        params, state, value = step(params, state)
        values.append(float(value))
    return params, values


def run_raw(tx, params, steps, jit, **value_fn):
    def step(params, state):
        value, grad = jax.value_and_grad(objective)(params)
        updates, state = tx.update(grad, state, params, value=value, grad=grad, **value_fn)
        return optax.apply_updates(params, updates), state, value

    return run(step, params, tx.init(params), steps, jit)


def run_treeopt(tx, params, steps, jit, **value_fn):
    def step(params, opt):
        value, grad = jax.value_and_grad(objective)(params)
        params = opt.update(grad, params, value=value, grad=grad, **value_fn)
        return params, opt, value

    return run(step, params, treeopt.Optimizer(tx).init(params), steps, jit)


assert_trees_close = functools.partial(_helpers.assert_trees_close, **EAGER_TOL)


# -- L-BFGS (zoom line search: value, grad and value_fn) --------------------------------


def test_lbfgs_equals_raw_optax_bit_for_bit_under_jit_and_to_rounding_eagerly():
    tx = optax.lbfgs()
    want_params, want = run_raw(tx, PARAMS, 12, jit=True, value_fn=objective)
    got_params, got = run_treeopt(tx, PARAMS, 12, jit=True, value_fn=objective)
    assert got == want
    assert got[-1] < 0.01 * got[0]
    assert_trees_equal(got_params, want_params)
    eager_params, eager = run_treeopt(tx, PARAMS, 12, jit=False, value_fn=objective)
    np.testing.assert_allclose(eager, want, **EAGER_TOL)
    assert_trees_close(eager_params, want_params)


def test_polyak_sgd_step_size_from_the_value_equals_raw_optax():
    tx = optax.polyak_sgd(max_learning_rate=1.0)  # needs value=: the loss sets each step's size
    want_params, want = run_raw(tx, PARAMS, 6, jit=True)
    got_params, got = run_treeopt(tx, PARAMS, 6, jit=True)
    assert got == want and got[-1] < got[0]
    assert_trees_equal(got_params, want_params)


def test_lbfgs_eager_compiles_once_for_the_same_value_fn():
    calls = 0

    def counted(params):
        nonlocal calls
        calls += 1  # Python runs only while tracing
        return objective(params)

    params = {**PARAMS, "head": [PARAMS["head"][0], jnp.array(0.5)]}
    assert params["head"][1].weak_type  # so are its gradient and grad=, until the first step
    opt = treeopt.Optimizer(optax.lbfgs()).init(params)
    for i in range(5):
        value, grad = jax.value_and_grad(objective)(params)
        params = opt.update(grad, params, value=value, grad=grad, value_fn=counted)
        if i == 0:
            traced = calls
    assert traced > 0 and calls == traced
    assert int(opt.step) == 5


def test_value_fn_sees_params_in_the_structure_given_to_update():
    seen = []

    def value_fn(params):
        seen.append(params)
        return objective(params)

    opt = treeopt.Optimizer(optax.lbfgs()).init(PARAMS)
    value, grad = jax.value_and_grad(objective)(PARAMS)
    opt.update(grad, PARAMS, value=value, grad=grad, value_fn=value_fn)
    assert seen and all(jax.tree.structure(p) == jax.tree.structure(PARAMS) for p in seen)


def test_value_fn_gets_untrained_leaves():
    """An equinox-like tree with a frozen leaf and a Python field reaches value_fn whole."""
    params = {"w": jnp.array([2.0, -1.0]), "frozen": jnp.array([0.5, 0.5]), "name": "toy", "n": jnp.int32(3)}
    traced = []

    def value_fn(p):
        assert p["name"] == "toy" and p["n"].dtype == jnp.int32
        traced.append(None)  # Python runs only while tracing
        return jnp.sum((p["w"] - p["frozen"]) ** 2)

    opt = treeopt.Optimizer(optax.lbfgs(), wrt="w").init(params)
    first = None
    for _ in range(3):
        value, g = jax.value_and_grad(lambda w, p=params: jnp.sum((w - p["frozen"]) ** 2))(params["w"])
        grad = {"w": g}  # the trained entries only, matched by name
        params = opt.update(grad, params, value=value, grad=grad, value_fn=value_fn)
        first = len(traced) if first is None else first
        params = {**params, "n": params["n"] + 1}  # an untrained array that changes, as batch statistics do
    # The untrained arrays are inputs of the compiled step, not its cache key: it compiles once.
    assert first > 0 and len(traced) == first
    np.testing.assert_allclose(np.asarray(params["w"]), [0.5, 0.5], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(params["frozen"]), [0.5, 0.5])


class _TwoLayers(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(2, 3, rngs=rngs), nnx.Linear(3, 1, rngs=rngs)])
        self.calls = nnx.Variable(jnp.int32(0))  # not a Param: part of the rest value_fn merges with

    def __call__(self, x):
        return self.layers[1](jnp.tanh(self.layers[0](x)))


_X = jnp.array([[1.0, 2.0], [-1.0, 0.5], [0.3, 0.3], [0.0, -1.0]])
_Y = jnp.array([[1.0], [0.0], [0.5], [-0.5]])


def _loss(model):
    return jnp.mean((model(_X) - _Y) ** 2)


def _lbfgs_losses(make_optimizer, nnx_order, jit, steps=4):
    """L-BFGS on a fresh model; value_fn merges the state it gets with the model's graphdef and rest."""
    model = _TwoLayers(nnx.Rngs(0))
    opt = make_optimizer(model)
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    seen = []

    def value_fn(state):
        seen.append(state)
        return _loss(nnx.merge(graphdef, state, rest, copy=True))

    def step(model, opt):
        value, grads = nnx.value_and_grad(_loss)(model)
        if nnx_order:
            opt.update(model, grads, value=value, grad=grads, value_fn=value_fn)
        else:
            opt.update(grads, model, value=value, grad=grads, value_fn=value_fn)
        return value, opt  # a treeopt.Optimizer is a pytree: returned from the step

    step = nnx.jit(step) if jit else step
    losses = []
    for _ in range(steps):
        value, opt = step(model, opt)
        losses.append(float(value))
    return losses, seen, model


def test_value_fn_of_a_module_gets_an_nnx_state_as_nnx_optimizer_gives_it():
    """For an nnx Module, value_fn(state) gets an ``nnx.State`` of the trained values, keyed and
    shaped as ``nnx.as_pure(nnx.state(model, nnx.Param))``: L-BFGS then follows nnx.Optimizer's
    (under nnx.jit, the reference for both treeopt runs), under nnx.jit and eagerly."""
    nnx_losses, nnx_seen, reference = _lbfgs_losses(
        lambda m: nnx.Optimizer(m, optax.lbfgs(), wrt=nnx.Param), True, jit=True
    )
    pure = nnx.as_pure(nnx.state(reference, nnx.Param))
    assert all(jax.tree.structure(s) == jax.tree.structure(pure) for s in nnx_seen)
    for jit in (True, False):
        losses, seen, model = _lbfgs_losses(lambda m: treeopt.Optimizer(optax.lbfgs()).init(m), False, jit)
        assert seen and all(type(s) is nnx.State for s in seen)
        assert all(jax.tree.structure(s) == jax.tree.structure(pure) for s in seen)
        assert losses[-1] < 0.5 * losses[0]
        if jit:  # the same program: bit for bit
            assert losses == nnx_losses
            assert_trees_equal(nnx.as_pure(nnx.state(model, nnx.Param)), pure)
        else:
            np.testing.assert_allclose(losses, nnx_losses, **EAGER_TOL)


def test_grad_shaped_like_params_reaches_tx_in_the_params_structure():
    seen = {}

    def update(updates, state, params=None, *, grad, **extra):
        seen["grad"] = grad
        return updates, state

    tx = optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)
    opt = treeopt.Optimizer(tx).init(PARAMS)
    grads = jax.grad(objective)(PARAMS)
    opt.update(grads, PARAMS, grad=grads)
    # As tx sees the grads and params: the user's structure, whatever treeopt keys its state by.
    assert jax.tree.structure(seen["grad"]) == jax.tree.structure(grads)
    assert treeopt.leaf_names(seen["grad"]) == treeopt.leaf_names(grads)
    assert seen["grad"]["encoder"]["w"].shape == (2, 2) and seen["grad"]["head"][1].shape == ()
    # A grad= given by name (the trained entries only) is matched by name and handed over the same way.
    opt.update(grads, PARAMS, grad=dict(zip(treeopt.leaf_names(grads), jax.tree.leaves(grads), strict=True)))
    assert jax.tree.structure(seen["grad"]) == jax.tree.structure(grads)


def test_zoom_linesearch_on_its_own_and_backtracking_take_value_fn():
    for tx in (
        optax.chain(optax.sgd(1.0), optax.scale_by_zoom_linesearch(max_linesearch_steps=10)),
        optax.chain(optax.sgd(1.0), optax.scale_by_backtracking_linesearch(max_backtracking_steps=10)),
    ):
        want_params, want = run_raw(tx, PARAMS, 3, jit=True, value_fn=objective)
        got_params, got = run_treeopt(tx, PARAMS, 3, jit=True, value_fn=objective)
        assert got == want
        assert_trees_equal(got_params, want_params)
        run_treeopt(tx, PARAMS, 2, jit=False, value_fn=objective)  # and eagerly


# -- reduce_on_plateau (value) ------------------------------------------------------------


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_reduce_on_plateau_agrees_with_raw_optax(jit):
    tx = optax.chain(optax.adam(0.3), optax.contrib.reduce_on_plateau(patience=1, factor=0.5, cooldown=0))
    steps = 12
    want_params, want = run_raw(tx, PARAMS, steps, jit=True)
    got_params, got = run_treeopt(tx, PARAMS, steps, jit=jit)
    if jit:
        assert got == want
        assert_trees_equal(got_params, want_params)
    else:
        np.testing.assert_allclose(got, want, **EAGER_TOL)
        assert_trees_close(got_params, want_params)


def test_value_of_a_scalar_params_array_stays_the_objective_value():
    """Params that are one scalar array: ``value=`` has the params' shape but is the loss, not per-parameter."""
    tx = optax.chain(optax.adam(0.3), optax.contrib.reduce_on_plateau(patience=1, factor=0.5, cooldown=0))

    def loss(w):
        return (w - 2.0) ** 2

    params, state = jnp.float32(0.0), tx.init(jnp.float32(0.0))
    opt = treeopt.Optimizer(tx).init(params)
    got = params
    for _ in range(6):
        value, grad = jax.value_and_grad(loss)(params)
        updates, state = tx.update(grad, state, params, value=value)
        params = optax.apply_updates(params, updates)
        value, grad = jax.value_and_grad(loss)(got)
        got = opt.update(grad, got, value=value)
    np.testing.assert_allclose(got, params, **EAGER_TOL)


# -- functions among the extra arguments of the pure step -----------------------------------


def test_flat_step_takes_functions_and_unhashable_objects_eagerly():
    def update(updates, state, params=None, *, scale_fn, **extra):
        return jax.tree.map(lambda u: scale_fn(u), updates), state

    tx = optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)
    params = {"w": jnp.ones(2)}

    def double(u):
        return 2 * u

    out = flat_step(tx, jnp.int32(0), optax.EmptyState(), params, params, extra_args={"scale_fn": double})
    np.testing.assert_array_equal(out.output["w"], [3.0, 3.0])

    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, u):
            return -u

    out = flat_step(tx, jnp.int32(0), optax.EmptyState(), params, params, extra_args={"scale_fn": Unhashable()})
    np.testing.assert_array_equal(out.output["w"], [0.0, 0.0])
