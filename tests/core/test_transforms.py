"""The Optimizer under JAX transformations: vmap, donated buffers, eager use, grad, shard_map.

Every check compares against the same computation written with raw optax on
the same pytree. Elementwise optimizers on identical float32 inputs differ
only by XLA fusion, so params and states are compared with
``rtol=1e-5, atol=1e-6`` (``TOL``); meta-gradients, which go through several
differentiated steps, with ``rtol=1e-4, atol=1e-6`` (``GRAD_TOL``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import treeopt

import _helpers
from _helpers import device_mesh

TOL = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}
STEPS = 5

_kx, _ky = jax.random.split(jax.random.key(0))
X = jax.random.normal(_kx, (16, 4))
Y = jax.random.normal(_ky, (16, 2))


def make_params(seed: int = 1) -> dict:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "dense": {"kernel": jax.random.normal(k1, (4, 3)) * 0.5, "bias": jnp.zeros(3)},
        "head": {"kernel": jax.random.normal(k2, (3, 2)) * 0.5},
    }


def loss_fn(params, x=X, y=Y):
    h = jnp.tanh(x @ params["dense"]["kernel"] + params["dense"]["bias"])
    return jnp.mean((h @ params["head"]["kernel"] - y) ** 2)


assert_trees_close = functools.partial(_helpers.assert_trees_close, **TOL)


def treeopt_step(params, opt):
    grads = jax.grad(loss_fn)(params)
    params = opt.update(grads, params)
    return params, opt


@functools.partial(jax.jit, static_argnums=0)
def raw_step(tx, params, state):
    grads = jax.grad(loss_fn)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def raw_steps(tx, params, steps: int = STEPS, state=None):
    """``steps`` jitted steps of raw optax; returns (params, state)."""
    state = tx.init(params) if state is None else state
    for _ in range(steps):
        params, state = raw_step(tx, params, state)
    return params, state


# -- vmap ---------------------------------------------------------------------------


def test_vmap_batch_of_independent_optimizers():
    """init and update under vmap: each member has its own params, state and learning rate."""
    members = 3
    params_list = [make_params(seed) for seed in range(members)]
    batched = jax.tree.map(lambda *xs: jnp.stack(xs), *params_list)
    lrs = jnp.array([0.1, 0.03, 0.01])
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)

    @jax.vmap
    def init(params, lr):
        opt = treeopt.Optimizer(tx).init(params)
        opt.learning_rate = lr
        return opt

    opt = init(batched, lrs)
    assert opt.step.shape == (members,)
    assert opt.opt_state.inner_state[0].mu["dense/kernel"].shape == (members, 4, 3)
    np.testing.assert_allclose(np.asarray(opt.learning_rate), np.asarray(lrs), rtol=1e-6)

    step = jax.jit(jax.vmap(treeopt_step))
    params = batched
    for _ in range(STEPS):
        params, opt = step(params, opt)
    np.testing.assert_array_equal(np.asarray(opt.step), [STEPS] * members)

    for i in range(members):
        state = tx.init(params_list[i])
        state.hyperparams["learning_rate"] = lrs[i]
        expected, expected_state = raw_steps(tx, params_list[i], state=state)
        assert_trees_close(jax.tree.map(lambda x, i=i: x[i], params), expected)
        nu = jax.tree.map(lambda x, i=i: x[i], opt.opt_state.inner_state[0].nu)
        assert_trees_close(jax.tree.leaves(nu), jax.tree.leaves(expected_state.inner_state[0].nu))
    # The members really differ (different seeds and learning rates).
    assert not np.allclose(np.asarray(params["head"]["kernel"][0]), np.asarray(params["head"]["kernel"][1]))


def test_vmap_update_of_a_batch_built_outside():
    """A batch of optimizers stacked from separately initialized ones, updated under vmap."""
    params_list = [make_params(seed) for seed in range(2)]
    tx = optax.adam(0.05)
    opts = [treeopt.Optimizer(tx).init(p) for p in params_list]
    opt = jax.tree.map(lambda *xs: jnp.stack(xs), *opts)
    params = jax.tree.map(lambda *xs: jnp.stack(xs), *params_list)
    assert opt.paths == opts[0].paths

    step = jax.jit(jax.vmap(treeopt_step))
    for _ in range(STEPS):
        params, opt = step(params, opt)

    for i, p in enumerate(params_list):
        expected, _ = raw_steps(tx, p)
        assert_trees_close(jax.tree.map(lambda x, i=i: x[i], params), expected)


# -- donate_argnums -----------------------------------------------------------------


def test_donated_params_and_optimizer():
    tx = optax.adam(0.05)
    params = make_params()
    opt = treeopt.Optimizer(tx).init(params)
    step = jax.jit(treeopt_step, donate_argnums=(0, 1))

    for _ in range(STEPS):
        inputs = jax.tree.leaves((params, opt))
        params, opt = step(params, opt)
        # The buffers handed in were donated to the outputs: none kept alive.
        assert inputs and all(leaf.is_deleted() for leaf in inputs)
        assert not any(leaf.is_deleted() for leaf in jax.tree.leaves((params, opt)))

    assert int(opt.step) == STEPS
    expected, expected_state = raw_steps(tx, make_params())
    assert_trees_close(params, expected)
    assert_trees_close(
        opt.opt_state[0].mu,
        {
            "dense/bias": expected_state[0].mu["dense"]["bias"],
            "dense/kernel": expected_state[0].mu["dense"]["kernel"],
            "head/kernel": expected_state[0].mu["head"]["kernel"],
        },
    )


# -- eager --------------------------------------------------------------------------


def counting(tx: optax.GradientTransformation, counter: dict) -> optax.GradientTransformation:
    """``tx`` with a Python counter bumped each time its update is *traced* (or run op by op)."""

    def update(updates, state, params=None):
        counter["calls"] += 1
        return tx.update(updates, state, params)

    return optax.GradientTransformation(tx.init, update)


def test_eager_update_equals_jitted_and_raw_optax():
    tx = optax.adamw(0.05, weight_decay=0.1)
    eager_params = jitted_params = make_params()
    eager = treeopt.Optimizer(tx).init(eager_params)
    jitted = treeopt.Optimizer(tx).init(jitted_params)
    step = jax.jit(treeopt_step)

    for _ in range(STEPS):
        grads = jax.grad(loss_fn)(eager_params)
        eager_params = eager.update(grads, eager_params)  # no user jit: updates `eager` in place
        jitted_params, jitted = step(jitted_params, jitted)

    assert int(eager.step) == STEPS
    assert_trees_close(eager_params, jitted_params)
    assert_trees_close(eager.opt_state, jitted.opt_state)
    expected, _ = raw_steps(tx, make_params())
    assert_trees_close(eager_params, expected)


def test_eager_update_returns_updates():
    tx = optax.sgd(0.1, momentum=0.9)
    params = make_params()
    opt = treeopt.Optimizer(tx).init(params)
    state = tx.init(params)
    for _ in range(3):
        grads = jax.grad(loss_fn)(params)
        updates = opt.update(grads, params, apply_updates=False)
        expected, state = tx.update(grads, state, params)
        assert_trees_close(updates, expected)
        params = optax.apply_updates(params, updates)


def test_eager_update_compiles_once_per_tx_and_structure():
    counter = {"calls": 0}
    tx = counting(optax.adam(0.05), counter)
    params = make_params()
    opt = treeopt.Optimizer(tx).init(params)
    counter["calls"] = 0  # init traces the update once (shapes only) to fix the state's dtypes

    for _ in range(10):
        params = opt.update(jax.grad(loss_fn)(params), params)
    assert counter["calls"] == 1  # traced once, then the cached executable ran 9 more times
    assert int(opt.step) == 10

    # Another optimizer with the same tx and params structure reuses the compiled update.
    other = treeopt.Optimizer(tx).init(make_params(seed=7))
    counter["calls"] = 1
    other.update(jax.grad(loss_fn)(make_params(seed=7)), make_params(seed=7))
    assert counter["calls"] == 1

    # A new params structure is a new program: one more trace, then cached again.
    small = {"w": jnp.ones(3)}
    small_opt = treeopt.Optimizer(tx).init(small)
    counter["calls"] = 1
    for _ in range(3):
        small = small_opt.update({"w": jnp.full(3, 0.5)}, small)
    assert counter["calls"] == 2

    # Returning the updates instead of params is the other cached variant.
    for _ in range(3):
        small_opt.update({"w": jnp.full(3, 0.5)}, small, apply_updates=False)
    assert counter["calls"] == 3

    # Still the same compiled step for the first optimizer, and it still matches raw optax.
    params = opt.update(jax.grad(loss_fn)(params), params)
    assert counter["calls"] == 3
    expected, _ = raw_steps(optax.adam(0.05), make_params(), steps=11)
    assert_trees_close(params, expected)


# -- jax.grad through an update -------------------------------------------------------


def test_meta_gradient_wrt_learning_rate_through_jitted_updates():
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.05)
    params = make_params()
    opt = treeopt.Optimizer(tx).init(params)

    @jax.jit
    def after_steps(lr, params, opt):
        opt.learning_rate = lr
        for _ in range(3):
            params = opt.update(jax.grad(loss_fn)(params), params)
        return loss_fn(params)

    def raw_after_steps(lr, params):
        state = tx.init(params)
        state.hyperparams["learning_rate"] = lr
        for _ in range(3):
            grads = jax.grad(loss_fn)(params)
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        return loss_fn(params)

    lr = jnp.float32(0.05)
    value, meta_grad = jax.value_and_grad(after_steps)(lr, params, opt)
    raw_value, raw_meta_grad = jax.jit(jax.value_and_grad(raw_after_steps))(lr, params)
    np.testing.assert_allclose(float(value), float(raw_value), **TOL)
    np.testing.assert_allclose(float(meta_grad), float(raw_meta_grad), **GRAD_TOL)
    assert float(meta_grad) != 0.0
    assert int(opt.step) == 0  # the caller's optimizer is untouched by the traced updates


def test_meta_gradient_wrt_params_through_jitted_updates():
    """MAML-style: the gradient of the post-update loss w.r.t. the initial params."""
    tx = optax.adam(0.05)
    params = make_params()
    opt = treeopt.Optimizer(tx).init(params)
    x_val, y_val = X[:8] * 2.0, Y[:8]

    @jax.jit
    def outer(params, opt):
        for _ in range(2):
            params = opt.update(jax.grad(loss_fn)(params), params)
        return loss_fn(params, x_val, y_val)

    def raw_outer(params):
        state = tx.init(params)
        for _ in range(2):
            grads = jax.grad(loss_fn)(params)
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        return loss_fn(params, x_val, y_val)

    meta = jax.grad(outer)(params, opt)
    expected = jax.jit(jax.grad(raw_outer))(params)
    assert_trees_close(meta, expected, **GRAD_TOL)
    assert float(jnp.abs(meta["dense"]["kernel"]).max()) > 0


def test_grad_of_eager_function_creating_its_optimizer():
    """No jit anywhere: the optimizer is built inside the differentiated function."""
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
    params = make_params()

    def after_steps(lr):
        opt = treeopt.Optimizer(tx).init(params)
        opt.learning_rate = lr
        p = params
        for _ in range(2):
            p = opt.update(jax.grad(loss_fn)(p), p)
        return loss_fn(p)

    def raw_after_steps(lr):
        state = tx.init(params)
        state.hyperparams["learning_rate"] = lr
        p = params
        for _ in range(2):
            updates, state = tx.update(jax.grad(loss_fn)(p), state, p)
            p = optax.apply_updates(p, updates)
        return loss_fn(p)

    got = jax.grad(after_steps)(jnp.float32(0.1))
    expected = jax.jit(jax.grad(raw_after_steps))(jnp.float32(0.1))
    np.testing.assert_allclose(float(got), float(expected), **GRAD_TOL)


def test_grad_of_eager_function_taking_and_returning_the_optimizer():
    """No jit: the optimizer goes in undifferentiated and comes back as aux, like any state."""
    tx = optax.adam(0.05)
    params = make_params()
    opt = treeopt.Optimizer(tx).init(params)
    x_val, y_val = X[:8] * 2.0, Y[:8]

    def outer(params, opt):
        p = params
        for _ in range(2):
            p = opt.update(jax.grad(loss_fn)(p), p)
        return loss_fn(p, x_val, y_val), opt

    def raw_outer(params):
        state, p = tx.init(params), params
        for _ in range(2):
            updates, state = tx.update(jax.grad(loss_fn)(p), state, p)
            p = optax.apply_updates(p, updates)
        return loss_fn(p, x_val, y_val), state

    (value, opt), meta = jax.value_and_grad(outer, has_aux=True)(params, opt)
    (raw_value, raw_state), raw_meta = jax.jit(jax.value_and_grad(raw_outer, has_aux=True))(params)
    np.testing.assert_allclose(float(value), float(raw_value), **TOL)
    assert_trees_close(meta, raw_meta, **GRAD_TOL)
    assert int(opt.step) == 2
    assert_trees_close(jax.tree.leaves(opt.opt_state), jax.tree.leaves(raw_state))


# -- shard_map ----------------------------------------------------------------------


@pytest.mark.parametrize("tx_name", ["adam", "chain_clip_adamw"])
def test_shard_map_with_optimizer_passed_in(tx_name):
    """Data parallel over 8 devices: params and optimizer replicated (P()), batch sharded."""
    assert jax.device_count() == 8
    tx = {
        "adam": optax.adam(0.05),
        "chain_clip_adamw": optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(0.05, weight_decay=0.1)),
    }[tx_name]
    mesh = device_mesh((8,), ("data",), "default")
    x = jax.device_put(X, NamedSharding(mesh, P("data")))
    y = jax.device_put(Y, NamedSharding(mesh, P("data")))
    params = make_params()
    opt = treeopt.Optimizer(tx).init(params)

    @jax.jit
    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), P(), P("data"), P("data")),
        out_specs=(P(), P()),
    )
    def step(params, opt, x, y):
        # The global loss is the mean of the shards' losses; params are replicated
        # (invariant over "data"), so its gradient arrives already reduced over the shards.
        grads = jax.grad(lambda p: jax.lax.pmean(loss_fn(p, x, y), "data"))(params)
        params = opt.update(grads, params)
        return params, opt

    for _ in range(STEPS):
        params, opt = step(params, opt, x, y)

    assert int(opt.step) == STEPS
    assert isinstance(opt, treeopt.Optimizer) and opt.paths == ("dense/bias", "dense/kernel", "head/kernel")
    # Equal shards: the mean of the per-shard mean losses is the full-batch mean loss.
    expected, expected_state = raw_steps(tx, make_params())
    assert_trees_close(params, expected)
    assert_trees_close(jax.tree.leaves(opt.opt_state), jax.tree.leaves(expected_state))
