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


def test_a_wrt_predicate_is_asked_about_arrays_only_and_a_tree_of_none_trains_nothing():
    asked = []

    def everything(name, leaf):
        asked.append(name)
        return True

    with pytest.raises(ValueError, match="selects no leaf"):
        treeopt.Optimizer(optax.sgd(0.1), wrt=everything).init({"n": 3})
    assert asked == []


def test_lookahead_optimizer_needs_lookahead_params():
    params = {"w": jnp.ones(2)}
    tx = optax.lookahead(optax.sgd(0.1), sync_period=2, slow_step_size=0.5)
    opt = treeopt.Optimizer(tx).init(optax.LookaheadParams.init_synced(params))
    with pytest.raises(TypeError, match=re.escape("initialized with optax.LookaheadParams")):
        opt.update(params, params)


def test_label_rules_that_miss_a_name():
    with pytest.raises(ValueError, match=re.escape("Parameter 'b' matches no label rule ['a*']")):
        treeopt.labels({"a*": "x"})({"a": 1.0, "b": 2.0})


# -- a wrt that selects nothing ------------------------------------------------------------
# Training would run, step would count, and nothing would learn: refused at init.


def test_a_glob_that_matches_no_name_names_the_glob_and_the_names_there_are():
    with pytest.raises(ValueError, match=r"wrt='enc/\*' selects no leaf") as err:
        treeopt.Optimizer(optax.sgd(0.1), wrt="enc/*").init({"encoder": {"w": jnp.ones(2)}})
    assert "'encoder/w' (float32[2])" in str(err.value)
    assert "A glob matches whole names" in str(err.value)


def test_a_variable_type_on_a_plain_dict_says_dicts_have_no_variable_types():
    from flax import nnx

    with pytest.raises(ValueError, match=r"wrt=Param selects no leaf of the dict") as err:
        treeopt.Optimizer(optax.sgd(0.1), wrt=nnx.Param).init({"encoder": {"w": jnp.ones(2)}})
    assert "a plain dict has no Variable types" in str(err.value)
    with pytest.raises(ValueError, match=r"wrt=\(Param, BatchStat\) selects no leaf") as err:
        treeopt.Optimizer(optax.sgd(0.1), wrt=(nnx.Param, nnx.BatchStat)).init({"w": jnp.ones(2)})
    assert "no Variable types" in str(err.value)


def test_nnx_filters_that_select_nothing_name_the_variables_there_are():
    from flax import nnx

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"PathContains\('typo'.*selects no leaf of the Linear") as err:
        treeopt.Optimizer(optax.sgd(0.1), wrt=nnx.PathContains("typo")).init(model)
    assert "'bias' (Param float32[3]), 'kernel' (Param float32[2, 3])" in str(err.value)
    with pytest.raises(ValueError, match=r"wrt=BatchStat selects no leaf of the State") as err:
        treeopt.Optimizer(optax.sgd(0.1), wrt=nnx.BatchStat).init(nnx.state(model, nnx.Param))
    assert "no Variable types" not in str(err.value)  # a State has them; it holds no BatchStat


def test_a_predicate_that_selects_nothing():
    with pytest.raises(ValueError, match=r"wrt=<function .*selects no leaf of the dict.*'w' \(float32\[2\]\)"):
        treeopt.Optimizer(optax.sgd(0.1), wrt=lambda name, leaf: False).init({"w": jnp.ones(2)})


def test_params_without_a_float_leaf_are_refused_by_the_default_too():
    """``jnp.array([1, 2])`` is int32: the default trains floats, so integer params train nothing."""
    with pytest.raises(ValueError, match=r"wrt=None \(the default: floating-point arrays\) selects no leaf") as err:
        treeopt.Optimizer(optax.sgd(0.1)).init({"w": jnp.array([1, 2]), "n": jnp.int32(3)})
    assert "'n' (int32[]), 'w' (int32[2])" in str(err.value)
    assert "create params as floats" in str(err.value)


def test_an_nnx_module_without_params_is_refused_by_the_default():
    from flax import nnx

    class Stats(nnx.Module):
        def __init__(self):
            self.mean = nnx.BatchStat(jnp.zeros(2))

    with pytest.raises(ValueError, match=r"of nnx Variables the nnx.Param\) selects no leaf") as err:
        treeopt.Optimizer(optax.sgd(0.1)).init(Stats())
    assert "'mean' (BatchStat float32[2])" in str(err.value)


def test_an_empty_selection_lists_a_few_names_and_the_count():
    params = {f"layer{i:02d}": jnp.int32(i) for i in range(12)}
    with pytest.raises(ValueError, match=r"'layer07' \(int32\[\]\), \.\.\. \(12 leaves in all\)") as err:
        treeopt.Optimizer(optax.sgd(0.1)).init(params)
    assert "'layer08'" not in str(err.value)


def test_params_with_no_leaves_at_all_are_accepted():
    """Nothing to select from is not a wrong selection (an empty sub-model, a generic loop)."""
    opt = treeopt.Optimizer(optax.sgd(0.1)).init({})
    assert opt.paths == () and opt.update({}, {}) == {} and int(opt.step) == 1


def test_a_selection_of_one_leaf_is_enough():
    opt = treeopt.Optimizer(optax.sgd(0.1), wrt="encoder/*").init({"encoder": {"w": jnp.ones(2)}, "n": 1})
    assert opt.paths == ("encoder/w",)
