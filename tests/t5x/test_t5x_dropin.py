"""treeopt.t5x as a drop-in for T5X: the module mirror, T5X's names and signatures, its checkpoints.

The facts here come from reading T5X's ``t5x/optimizers.py`` and
``t5x/train_state.py``; T5X itself is not installed. "T5X's original
optimizer" for an optax transformation is what T5X's ``OptaxWrapper`` runs:
``tx.init(target)``, then ``tx.update`` and ``optax.apply_updates`` on the
target tree, the state dict being ``flax.serialization.to_state_dict`` of the
state with the empty dicts of ``EmptyState`` left out.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util
from flax.core import FrozenDict
from jax.sharding import PartitionSpec as P

import treeopt.t5x
from treeopt.t5x import optimizers

# -- the module mirror ----------------------------------------------------------------------


def test_the_package_exposes_the_two_t5x_modules():
    assert set(treeopt.t5x.__all__) == {"adafactor", "optimizers"}
    assert treeopt.t5x.optimizers is optimizers
    # One name per thing: no optimizer names star-exported over the module names.
    for name in ("sgd", "adamw", "OptaxWrapper", "Adafactor", "legacy_adafactor"):
        assert not hasattr(treeopt.t5x, name)
    assert not hasattr(optimizers, "adafactor")  # T5X's optimizers has no `adafactor` either


T5X_OPTIMIZERS_NAMES = [
    # Every name T5X's own code and tests use from t5x.optimizers (jestimator's amos aside).
    "OptimizerState", "OptimizerDef", "Optimizer", "OptimizerType", "OptimizerStateType",
    "OptimizerDefType", "OptaxStatePartitionRules", "_OptaxWrapperHyperParams", "OptaxWrapper",
    "wrap_optax_optimizer", "chain", "adabelief", "adagrad", "adam", "adamw", "fromage", "lars",
    "lamb", "lion", "noisy_sgd", "radam", "rmsprop", "sgd", "yogi", "dpsgd", "MultiOptimizer",
    "freeze", "unfreeze", "_scale_by_schedule_ctor",
]  # fmt: skip


@pytest.mark.parametrize("name", T5X_OPTIMIZERS_NAMES)
def test_every_t5x_name_is_in_the_module(name):
    assert hasattr(optimizers, name)


def test_type_aliases_are_t5x_s():
    assert optimizers.OptimizerType is optimizers.Optimizer
    assert optimizers.OptimizerDefType is optimizers.OptimizerDef
    assert set(optimizers.OptimizerStateType.__args__) >= {optimizers.OptimizerState}


# -- signatures ----------------------------------------------------------------------------


def _t5x_parameters(fn):
    """The parameters of ``fn`` but the keyword-only opt-in treeopt adds: T5X's, in T5X's order."""
    parameters = inspect.signature(fn).parameters
    assert parameters["honor_learning_rate"].kind is inspect.Parameter.KEYWORD_ONLY
    assert parameters["honor_learning_rate"].default is False
    return [p for name, p in parameters.items() if name != "honor_learning_rate"]


def test_chain_takes_one_sequence_like_t5x():
    assert [p.name for p in _t5x_parameters(optimizers.chain)] == ["transformations"]
    params = {"w": jnp.ones(3)}
    opt = optimizers.chain(transformations=[optax.clip(0.5), optax.sgd(1.0)]).create(params)
    opt = opt.apply_gradient({"w": jnp.full(3, 2.0)})
    np.testing.assert_allclose(opt.target["w"], 0.5)
    with pytest.raises(TypeError):
        optimizers.chain(optax.clip(0.5), optax.sgd(1.0))


def test_multi_optimizer_takes_one_sequence_of_pairs_like_t5x():
    assert list(inspect.signature(optimizers.MultiOptimizer).parameters) == ["traversals_and_optimizers"]
    everything = traverse_util.ModelParamTraversal(lambda path, _: True)
    opt_def = optimizers.MultiOptimizer(traversals_and_optimizers=[(everything, optimizers.sgd(0.1))])
    assert opt_def.traversals == (everything,) and len(opt_def.sub_optimizers) == 1
    assert opt_def.hyper_params == [optimizers._OptaxWrapperHyperParams()]


def test_optax_wrapper_is_t5x_s():
    assert [p.name for p in _t5x_parameters(optimizers.OptaxWrapper)] == ["optax_optimizer"]
    tx = optax.adam(0.1)
    wrapper = optimizers.OptaxWrapper(tx)
    assert wrapper.optax_optimizer is tx
    assert wrapper.hyper_params == optimizers._OptaxWrapperHyperParams(learning_rate=None)
    state = wrapper.init_state({"w": jnp.ones(2)})
    assert state.step == 0
    assert jax.tree.structure(state.param_states) == jax.tree.structure(tx.init({"w": jnp.ones(2)}))


def test_wrapped_aliases_keep_the_optax_signature():
    assert _t5x_parameters(optimizers.adamw) == list(inspect.signature(optax.adamw).parameters.values())
    lion = optimizers.wrap_optax_optimizer(optax.lion)
    assert _t5x_parameters(lion) == list(inspect.signature(optax.lion).parameters.values())
    assert isinstance(optimizers.adamw(learning_rate=0.1), optimizers.OptaxWrapper)


def test_set_param_axes_only_where_t5x_has_it():
    # T5X's FlaxOptimTrainState.create demands params_axes from any definition with set_param_axes.
    for opt_def in (optimizers.sgd(0.1), optimizers.adamw(0.1), optimizers.OptaxWrapper(optax.adam(0.1))):
        assert not hasattr(opt_def, "set_param_axes")
        assert hasattr(opt_def, "derive_logical_axes")
    everything = traverse_util.ModelParamTraversal(lambda path, _: True)
    assert hasattr(optimizers.MultiOptimizer([(everything, optimizers.sgd(0.1))]), "set_param_axes")


def test_the_base_definition_leaves_the_rule_to_subclasses():
    opt_def = optimizers.OptimizerDef(hyper_params=None)
    with pytest.raises(NotImplementedError):
        opt_def.init_state({"w": jnp.ones(2)})
    with pytest.raises(NotImplementedError):
        opt_def.apply_gradient(None, {}, optimizers.OptimizerState(0, {}), {})
    assert not hasattr(opt_def, "derive_logical_axes")


def test_equality_follows_t5x():
    # Dataclasses compare by value; optimizer definitions by identity, as in T5X.
    assert optimizers.OptimizerState(1, None) == optimizers.OptimizerState(1, None)
    assert optimizers._OptaxWrapperHyperParams() == optimizers._OptaxWrapperHyperParams(None)
    first, second = optimizers.sgd(0.1), optimizers.sgd(0.1)
    assert first == first and first != second
    target = {"w": 1.0}
    assert optimizers.Optimizer(first, optimizers.OptimizerState(0, ()), target) == optimizers.Optimizer(
        first, optimizers.OptimizerState(0, ()), target
    )


def test_optax_state_rules_keep_t5x_s_classmethods():
    rules = optimizers.OptaxStatePartitionRules
    assert rules._is_optax_state(optax.ScaleByAdamState(0, {}, {}))
    assert not rules._is_optax_state((1, 2)) and not rules._is_optax_state({"a": 1})
    assert rules.derive_params_axes({"a": 1.0, "b": optax.MaskedNode()}, {"a": P("x"), "b": P("y")}) == {
        "a": P("x"),
        "b": optax.MaskedNode(),
    }
    assert optimizers._scale_by_schedule_ctor(None, None) == optax.ScaleByScheduleState(count=None)


def test_a_rule_registered_for_a_state_type_takes_precedence(monkeypatch):
    rules = optimizers.OptaxStatePartitionRules
    monkeypatch.setitem(rules._RULES, optax.TraceState, lambda state, axes: optax.TraceState(trace="mine"))
    state = optax.sgd(0.1, momentum=0.9).init({"w": jnp.ones(2)})
    assert rules.derive_optax_logical_axes(state, {"w": P("embed")})[0] == optax.TraceState(trace="mine")


# -- the optax transformation sees the target, as in T5X --------------------------------------


def test_masks_written_against_the_target_tree_work():
    # T5X's own OptaxWrapper test trains only the decoder with a label function that
    # indexes the FrozenDict target by its top-level keys.
    def decoder_only(params):
        labels = jax.tree.map(lambda _: False, params)
        return labels.copy({"decoder": jax.tree.map(lambda _: True, labels["decoder"])})

    tx = optax.multi_transform({False: optax.set_to_zero(), True: optax.sgd(0.5)}, decoder_only)
    params = FrozenDict({"decoder": {"w": jnp.ones(2)}, "encoder": {"w": jnp.ones(2)}})
    opt = optimizers.OptaxWrapper(tx).create(params)
    opt = opt.apply_gradient(jax.tree.map(jnp.ones_like, params))
    assert isinstance(opt.target, FrozenDict)
    np.testing.assert_allclose(opt.target["decoder"]["w"], 0.5)
    np.testing.assert_allclose(opt.target["encoder"]["w"], 1.0)
    axes = opt.optimizer_def.derive_logical_axes(
        opt, FrozenDict({"decoder": {"w": P("a")}, "encoder": {"w": P("b")}})
    )
    assert isinstance(axes.target, FrozenDict) and axes.target["decoder"]["w"] == P("a")


# -- checkpoints: T5X's layout, both ways, step for step --------------------------------------

STEPS_BEFORE, STEPS_AFTER = 3, 4


def _params():
    rng = np.random.default_rng(0)
    return {
        "decoder": {"kernel": rng.normal(size=(3, 4)).astype(np.float32), "bias": np.zeros(4, np.float32)},
        "embed": {"embedding": rng.normal(size=(5, 3)).astype(np.float32)},
    }


def _grads(params, i):
    return jax.tree.map(lambda p: jnp.sin(p * (i + 2.0)) + 0.05 * p, params)


def _t5x_original_steps(tx, params, state, start, steps):
    """T5X's OptaxWrapper.apply_gradient, jitted as T5X's trainer jits it."""

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for i in range(start, start + steps):
        params, state = step(params, state, _grads(params, i))
    return params, state


def _adamw_layout(params, state, step):
    adam = state[0]
    return {
        "target": params,
        "state": {
            "step": np.int32(step),
            "param_states": {"0": {"count": adam.count, "mu": adam.mu, "nu": adam.nu}},
        },
    }


def _adamw_state(sd):
    entry = sd["state"]["param_states"]["0"]
    return (
        optax.ScaleByAdamState(entry["count"], entry["mu"], entry["nu"]),
        optax.EmptyState(),
        optax.EmptyState(),
    )


def _sgd_layout(params, state, step):
    return {
        "target": params,
        "state": {"step": np.int32(step), "param_states": {"0": {"trace": state[0].trace}}},
    }


def _sgd_state(sd):
    return (optax.TraceState(sd["state"]["param_states"]["0"]["trace"]), optax.EmptyState())


# name -> (treeopt.t5x definition, the same optax transformation, T5X layout writer, T5X layout reader)
CASES = {
    "adamw": (
        lambda: optimizers.adamw(learning_rate=1e-2, weight_decay=0.1),
        lambda: optax.adamw(1e-2, weight_decay=0.1),
        _adamw_layout,
        _adamw_state,
    ),
    "sgd_momentum": (
        lambda: optimizers.sgd(learning_rate=1e-2, momentum=0.9),
        lambda: optax.sgd(1e-2, momentum=0.9),
        _sgd_layout,
        _sgd_state,
    ),
}


def _assert_identical(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_array_equal(a, e)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_t5x_written_state_dict_restores_and_training_continues_identically(case):
    make_def, make_tx, layout, _ = CASES[case]
    tx = make_tx()
    params, state = _t5x_original_steps(tx, _params(), tx.init(_params()), 0, STEPS_BEFORE)
    checkpoint = jax.tree.map(np.asarray, layout(params, state, STEPS_BEFORE))  # as read back from disk

    opt = make_def().create(jax.tree.map(np.zeros_like, _params())).restore_state(checkpoint)
    assert int(opt.state.step) == STEPS_BEFORE
    for i in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        opt = opt.apply_gradient(_grads(opt.target, i))
        params, state = _t5x_original_steps(tx, params, state, i, 1)
        _assert_identical(opt.target, params)
        _assert_identical(opt.state.param_states, state)
    assert int(opt.state.step) == STEPS_BEFORE + STEPS_AFTER


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_treeopt_state_dict_is_t5x_s_layout_and_continues_in_t5x(case):
    make_def, make_tx, layout, read = CASES[case]
    opt = make_def().create(_params())
    for i in range(STEPS_BEFORE):
        opt = opt.apply_gradient(_grads(opt.target, i))
    sd = jax.tree.map(np.asarray, opt.state_dict())
    expected_layout = layout(opt.target, opt.state.param_states, STEPS_BEFORE)
    assert jax.tree.structure(sd) == jax.tree.structure(jax.tree.map(np.asarray, expected_layout))

    tx = make_tx()
    params, state = sd["target"], read(sd)
    for i in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        params, state = _t5x_original_steps(tx, params, state, i, 1)
        opt = opt.apply_gradient(_grads(opt.target, i))
        _assert_identical(params, opt.target)
        _assert_identical(state, opt.state.param_states)
