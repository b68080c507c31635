"""Bad input: each mistake gives one clear error naming the parameter path and what was expected."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax.core import freeze

import treeopt
from treeopt.errors import TreeMismatchError


@pytest.fixture
def params():
    return {"encoder": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}, "head": jnp.ones(3)}


@pytest.fixture
def opt(params):
    return treeopt.Optimizer(optax.adam(1e-2)).init(params)


def test_update_before_init(params):
    with pytest.raises(RuntimeError, match=re.escape("call `opt = opt.init(params)` first")):
        treeopt.Optimizer(optax.adam(1e-2)).update(params, params)


def test_paths_before_init():
    with pytest.raises(RuntimeError, match="not initialized"):
        _ = treeopt.Optimizer(optax.sgd(0.1)).paths


def test_grads_missing_a_param(opt, params):
    grads = {"encoder": {"kernel": jnp.ones((2, 3))}, "head": jnp.ones(3)}
    with pytest.raises(TreeMismatchError, match="grads do not match the params") as err:
        opt.update(grads, params)
    assert err.value.report.missing == ("encoder/bias",) and not err.value.report.unexpected
    assert "missing (1):\n  encoder/bias" in str(err.value)


def test_grads_with_an_extra_param(opt, params):
    grads = {**params, "decoder": {"kernel": jnp.ones(2)}}
    with pytest.raises(TreeMismatchError) as err:
        opt.update(grads, params)
    assert err.value.report.unexpected == ("decoder/kernel",) and not err.value.report.missing
    assert "unexpected (1):\n  decoder/kernel" in str(err.value)


def test_grads_of_another_shape(opt, params):
    grads = {**params, "head": jnp.ones(4)}
    with pytest.raises(ValueError, match=re.escape("head: expected float32[3], got float32[4]")):
        opt.update(grads, params)


def test_grads_of_another_dtype(opt, params):
    grads = {**params, "head": jnp.ones(3, jnp.bfloat16)}
    with pytest.raises(ValueError, match=re.escape("head: expected float32[3], got bfloat16[3]")):
        opt.update(grads, params)


def test_errors_are_raised_inside_jit_too(opt, params):
    step = jax.jit(lambda g, p, o: (o.update(g, p), o))
    with pytest.raises(ValueError, match=re.escape("head: expected float32[3], got float32[4]")):
        step({**params, "head": jnp.ones(4)}, params, opt)


def test_params_with_another_layer(opt, params):
    other = {**params, "decoder": jnp.ones(2)}
    with pytest.raises(ValueError, match=re.escape("unexpected (1):\n  decoder")):
        opt.update(params, other)


def test_params_missing_a_layer(opt, params):
    other = {"encoder": params["encoder"]}
    with pytest.raises(ValueError, match=re.escape("missing (1):\n  head")):
        opt.update(params, other)


def test_params_in_another_container(opt, params):
    with pytest.raises(TreeMismatchError, match="Same names, other containers"):
        opt.update(params, freeze(params))


def test_params_of_another_shape(opt, params):
    other = {**params, "head": jnp.ones(5)}
    with pytest.raises(ValueError, match=re.escape("head: expected float32[3], got float32[5]")):
        opt.update(params, other)


def test_params_none_with_apply_updates(opt, params):
    with pytest.raises(ValueError, match="needs the current params"):
        opt.update(params)


def test_tx_that_is_not_a_gradient_transformation():
    with pytest.raises(TypeError, match=re.escape("needs an optax.GradientTransformation")):
        treeopt.Optimizer(object())


def test_tx_factory_instead_of_transformation():
    with pytest.raises(TypeError, match=re.escape("did you pass the factory")):
        treeopt.Optimizer(optax.adam)


def test_setting_a_hyperparameter_that_does_not_exist(params):
    opt = treeopt.Optimizer(optax.inject_hyperparams(optax.adam)(learning_rate=0.1)).init(params)
    with pytest.raises(AttributeError, match=re.escape("no injected hyperparameter 'momentum'")):
        opt.momentum = 0.9


def test_setting_a_hyperparameter_without_inject_hyperparams(opt):
    with pytest.raises(AttributeError, match=re.escape("Build it with optax.inject_hyperparams")):
        opt.learning_rate = 0.1


def test_reading_an_unknown_attribute(opt):
    with pytest.raises(AttributeError, match="no attribute or injected hyperparameter 'lr'"):
        _ = opt.lr


def test_managed_fields_cannot_be_assigned(opt):
    with pytest.raises(AttributeError, match="managed by the optimizer"):
        opt.step = jnp.int32(3)


def test_optimizer_captured_by_closure_in_jit(opt, params):
    @jax.jit
    def train_step(params):
        return opt.update(params, params)

    with pytest.raises(RuntimeError, match=re.escape("Pass the optimizer as an argument")):
        train_step(params)
    assert int(opt.step) == 0  # nothing leaked into the captured optimizer


def test_name_collision_at_init():
    params = {"a/b": jnp.ones(1), "a": {"b": jnp.ones(1)}}
    with pytest.raises(ValueError, match=re.escape("share the name(s) ['a/b']")):
        treeopt.Optimizer(optax.sgd(0.1)).init(params)


def test_wrt_selecting_a_non_array():
    with pytest.raises(TypeError, match="wrt selected parameter 'n'"):
        treeopt.Optimizer(optax.sgd(0.1), wrt=lambda name, leaf: True).init({"n": 3})


def test_lookahead_optimizer_needs_lookahead_params():
    params = {"w": jnp.ones(2)}
    tx = optax.lookahead(optax.sgd(0.1), sync_period=2, slow_step_size=0.5)
    opt = treeopt.Optimizer(tx).init(optax.LookaheadParams.init_synced(params))
    with pytest.raises(TypeError, match=re.escape("initialized with optax.LookaheadParams")):
        opt.update(params, params)


def test_label_rules_that_miss_a_name():
    with pytest.raises(ValueError, match=re.escape("Parameter 'b' matches no label rule ['a*']")):
        treeopt.labels({"a*": "x"})({"a": 1.0, "b": 2.0})
