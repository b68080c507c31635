"""Runtime hyperparameters and the one-trace guarantee."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treeopt

PARAMS = {"dense": {"kernel": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "bias": jnp.ones(3)}}


def grads_at(params, i):
    return jax.tree.map(lambda p: jnp.sin(p * (i + 1.0)), params)


@pytest.mark.parametrize(
    "make",
    [
        lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
        lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=1e-2, momentum=0.9),
        lambda: optax.chain(
            optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2)
        ),
        lambda: optax.MultiSteps(optax.inject_hyperparams(optax.lion)(learning_rate=1e-3), 2),
    ],
    ids=["adam", "sgd_momentum", "chain_adamw", "multi_steps_lion"],
)
def test_learning_rate_changes_compile_once_and_match_raw_optax(make):
    traces = 0

    @jax.jit
    def step(params, opt, i):
        nonlocal traces
        traces += 1
        return opt.update(grads_at(params, i), params), opt

    tx = make()
    raw_tx = tx.gradient_transformation() if isinstance(tx, optax.MultiSteps) else tx
    raw_update = jax.jit(raw_tx.update)
    raw_state = raw_tx.init(PARAMS)
    raw_params = PARAMS
    params, opt = PARAMS, treeopt.Optimizer(tx).init(PARAMS)
    for i in range(50):
        lr = 1e-2 / (1 + i // 10)
        opt.learning_rate = lr
        params, opt = step(params, opt, i)
        raw_state = optax.tree_utils.tree_set(raw_state, learning_rate=jnp.float32(lr))
        updates, raw_state = raw_update(grads_at(raw_params, i), raw_state, raw_params)
        raw_params = optax.apply_updates(raw_params, updates)

    assert traces == 1
    assert int(opt.step) == 50
    np.testing.assert_allclose(float(opt.learning_rate), 1e-2 / 5, rtol=1e-6)
    # 50 steps, fused differently by XLA (gradient and update in one program vs two):
    # rounding accumulates to a few ulps.
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(raw_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_hyperparams_read_every_injected_value():
    opt = treeopt.Optimizer(optax.inject_hyperparams(optax.adam)(learning_rate=0.1, b1=0.8)).init(PARAMS)
    hp = opt.hyperparams
    assert set(hp) == {"learning_rate", "b1", "b2", "eps", "eps_root"}
    assert float(hp["b1"]) == pytest.approx(0.8)
    assert float(opt.learning_rate) == pytest.approx(0.1)


def test_setting_keeps_dtype_and_shape():
    opt = treeopt.Optimizer(optax.inject_hyperparams(optax.adam)(learning_rate=0.1)).init(PARAMS)
    before = opt.hyperparams["learning_rate"]
    opt.learning_rate = 3
    after = opt.hyperparams["learning_rate"]
    assert after.dtype == before.dtype and after.shape == before.shape
    assert float(after) == 3.0


def test_learning_rate_set_inside_jit_from_a_traced_value():
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=1.0)

    @jax.jit
    def step(params, opt, lr):
        opt.learning_rate = lr
        return opt.update(grads_at(params, 0), params), opt

    params, opt = step(PARAMS, treeopt.Optimizer(tx).init(PARAMS), 0.5)
    expected = jax.tree.map(lambda p, g: p - 0.5 * g, PARAMS, grads_at(PARAMS, 0))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert float(opt.learning_rate) == 0.5


def test_repeated_names_are_qualified_by_label():
    tx = optax.multi_transform(
        {
            "decay": optax.inject_hyperparams(optax.adamw)(learning_rate=0.1),
            "plain": optax.inject_hyperparams(optax.sgd)(learning_rate=0.2),
        },
        treeopt.labels({"*kernel": "decay"}, default="plain"),
    )
    opt = treeopt.Optimizer(tx).init(PARAMS)
    assert float(opt.hyperparams["decay/learning_rate"]) == pytest.approx(0.1)
    assert float(opt.hyperparams["plain/learning_rate"]) == pytest.approx(0.2)
    with pytest.raises(AttributeError, match=r"occurs several times; set one of \['decay/learning_rate'"):
        opt.learning_rate = 0.3
    opt.set_hyperparams({"plain/learning_rate": 0.0})
    # weight_decay occurs once (only adamw has it): it keeps its plain name.
    opt.weight_decay = 0.5

    new = opt.update(grads_at(PARAMS, 0), PARAMS)
    np.testing.assert_array_equal(new["dense"]["bias"], PARAMS["dense"]["bias"])  # lr 0: frozen
    assert not np.allclose(new["dense"]["kernel"], PARAMS["dense"]["kernel"])
    assert float(opt.weight_decay) == 0.5


def test_set_hyperparams_is_functional_on_raw_states():
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    state = tx.init(PARAMS)
    new = treeopt.set_hyperparams(state, {"learning_rate": 0.01})
    assert float(treeopt.get_hyperparams(state)["learning_rate"]) == pytest.approx(0.1)
    assert float(treeopt.get_hyperparams(new)["learning_rate"]) == pytest.approx(0.01)
