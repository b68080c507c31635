"""treeopt.t5x.optimizers against raw optax and T5X's documented formats.

Parity: N ``apply_gradient`` steps equal N raw optax steps on the same nested
params; element-wise transformations agree to float rounding, those with
global reductions to a sum's rounding, hence rtol=1e-6, atol=1e-7.
"""

from __future__ import annotations

import warnings

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import grads_at
from flax import traverse_util
from jax.sharding import PartitionSpec as P

import treeopt
from treeopt.t5x import optimizers

RTOL, ATOL = 1e-6, 1e-7
STEPS = 3


def make_params():
    return {
        "dense": {"kernel": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "bias": jnp.linspace(0.1, 0.4, 4)},
        "out": {"kernel": jnp.linspace(0.5, -0.5, 8).reshape(4, 2)},
    }


AXES = {
    "dense": {"kernel": P("embed", "mlp"), "bias": P("mlp")},
    "out": {"kernel": P("mlp", "vocab")},
}


def _numeric(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def assert_close(actual, expected, rtol=RTOL, atol=ATOL):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = _numeric(jnp.asarray(a)), _numeric(jnp.asarray(e))
        assert a.shape == e.shape and a.dtype == e.dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


def raw_optax(tx, params, steps=STEPS, grads_fn=grads_at):
    state = tx.init(params)

    @jax.jit
    def step(params, state, i):
        updates, state = tx.update(grads_fn(params, i), state, params)
        return optax.apply_updates(params, updates), state

    for i in range(steps):
        params, state = step(params, state, i)
    return params, state


def t5x_steps(opt, steps=STEPS, grads_fn=grads_at, **overrides):
    for i in range(steps):
        opt = opt.apply_gradient(grads_fn(opt.target, i), **overrides)
    return opt


# name -> (alias arguments, raw optax transformation)
ALIASES = {
    "adabelief": (dict(learning_rate=1e-2), lambda: optax.adabelief(1e-2)),
    "adadelta": (dict(learning_rate=1.0), lambda: optax.adadelta(1.0)),
    "adagrad": (dict(learning_rate=1e-2), lambda: optax.adagrad(1e-2)),
    "adam": (dict(learning_rate=1e-2), lambda: optax.adam(1e-2)),
    "adamax": (dict(learning_rate=1e-2), lambda: optax.adamax(1e-2)),
    "adamaxw": (dict(learning_rate=1e-2), lambda: optax.adamaxw(1e-2)),
    "adamw": (dict(learning_rate=1e-2, weight_decay=0.1), lambda: optax.adamw(1e-2, weight_decay=0.1)),
    "adan": (dict(learning_rate=1e-2), lambda: optax.adan(1e-2)),
    "amsgrad": (dict(learning_rate=1e-2), lambda: optax.amsgrad(1e-2)),
    "fromage": (dict(learning_rate=1e-2), lambda: optax.fromage(1e-2)),
    "lamb": (dict(learning_rate=1e-2), lambda: optax.lamb(1e-2)),
    "lars": (dict(learning_rate=1e-2), lambda: optax.lars(1e-2)),
    "lion": (dict(learning_rate=1e-3), lambda: optax.lion(1e-3)),
    "nadam": (dict(learning_rate=1e-2), lambda: optax.nadam(1e-2)),
    "nadamw": (dict(learning_rate=1e-2), lambda: optax.nadamw(1e-2)),
    "noisy_sgd": (
        dict(learning_rate=1e-2, key=jax.random.key(3)),
        lambda: optax.noisy_sgd(1e-2, key=jax.random.key(3)),
    ),
    "novograd": (dict(learning_rate=1e-2), lambda: optax.novograd(1e-2)),
    "optimistic_adam_v2": (dict(learning_rate=1e-2), lambda: optax.optimistic_adam_v2(1e-2)),
    "optimistic_gradient_descent": (
        dict(learning_rate=1e-2),
        lambda: optax.optimistic_gradient_descent(1e-2),
    ),
    "radam": (dict(learning_rate=1e-2), lambda: optax.radam(1e-2)),
    "rmsprop": (dict(learning_rate=1e-2, momentum=0.9), lambda: optax.rmsprop(1e-2, momentum=0.9)),
    "rprop": (dict(learning_rate=1e-2), lambda: optax.rprop(1e-2)),
    "sgd": (
        dict(learning_rate=1e-2, momentum=0.9, nesterov=True),
        lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    ),
    "sign_sgd": (dict(learning_rate=1e-2), lambda: optax.sign_sgd(1e-2)),
    "signum": (dict(learning_rate=1e-2), lambda: optax.signum(1e-2)),
    "sm3": (dict(learning_rate=1e-2), lambda: optax.sm3(1e-2)),
    "yogi": (dict(learning_rate=1e-2), lambda: optax.yogi(1e-2)),
}


def test_every_alias_is_checked():
    wrapped = {
        name
        for name in optimizers.__all__
        if name.islower() and name not in ("wrap_optax_optimizer", "chain", "dpsgd")
    }
    assert wrapped == set(ALIASES)
    t5x_names = {"chain", "adabelief", "adagrad", "adam", "adamw", "fromage", "lars", "lamb", "lion",
                 "noisy_sgd", "radam", "rmsprop", "sgd", "yogi", "dpsgd"}  # fmt: skip
    assert t5x_names <= set(optimizers.__all__)


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_alias_matches_raw_optax(name):
    kwargs, make_raw = ALIASES[name]
    params = make_params()
    opt = t5x_steps(getattr(optimizers, name)(**kwargs).create(params))
    expected, expected_state = raw_optax(make_raw(), params)
    assert int(opt.state.step) == STEPS
    assert_close(opt.target, expected)
    # param_states is the optax state shaped like the target, as T5X stores it.
    assert jax.tree.structure(opt.state.param_states) == jax.tree.structure(expected_state)
    assert_close(opt.state.param_states, expected_state)


def test_chain_matches_raw_optax():
    params = make_params()
    make = lambda: [optax.clip_by_global_norm(0.5), optax.adam(1e-2)]  # noqa: E731
    opt = t5x_steps(optimizers.chain(make()).create(params))
    assert_close(opt.target, raw_optax(optax.chain(*make()), params)[0])


def test_dpsgd_takes_per_example_gradients_like_raw_optax():
    params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)}
    batch = jnp.arange(4.0)[:, None, None]

    def per_example(params, i):
        return jax.tree.map(lambda p: jnp.cos(p * (i + 1.0))[None] * (1.0 + batch), params)

    make = lambda: dict(learning_rate=0.1, l2_norm_clip=0.5, noise_multiplier=0.1, seed=7)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        opt = t5x_steps(optimizers.dpsgd(**make()).create(params), grads_fn=per_example)
        raw = (getattr(optax.contrib, "dpsgd", None) or optax.dpsgd)(**make())
        assert_close(opt.target, raw_optax(raw, params, grads_fn=per_example)[0])


# -- learning rate overrides --------------------------------------------------------------


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd", "lion"])
def test_learning_rate_override_sets_the_step_size(name):
    params = make_params()
    factory = getattr(optax, name)
    opt_def = getattr(optimizers, name)(learning_rate=1.0, honor_learning_rate=True)
    opt = t5x_steps(opt_def.create(params), learning_rate=0.01)
    expected, expected_state = raw_optax(factory(0.01), params)
    assert_close(opt.target, expected)
    assert_close(opt.state.param_states, expected_state)


def test_learning_rate_override_inside_a_jitted_step_traces_once():
    params = make_params()
    traces = []

    @jax.jit
    def train_step(opt, lr, i):
        traces.append(None)
        return opt.apply_gradient(grads_at(opt.target, i), learning_rate=lr)

    opt = optimizers.adamw(learning_rate=1.0, weight_decay=0.1, honor_learning_rate=True).create(params)
    for i, lr in enumerate([0.01, 0.02, 0.005]):
        opt = train_step(opt, jnp.float32(lr), i)
    assert len(traces) == 1

    tx_state = optax.adamw(0.01, weight_decay=0.1).init(params)
    expected = params
    for i, lr in enumerate([0.01, 0.02, 0.005]):
        tx = optax.adamw(lr, weight_decay=0.1)
        updates, tx_state = tx.update(grads_at(expected, i), tx_state, expected)
        expected = optax.apply_updates(expected, updates)
    assert_close(opt.target, expected)


def test_a_scheduled_learning_rate_is_overridden_and_keeps_its_state():
    params = make_params()
    schedule = optax.linear_schedule(1.0, 0.0, 10)
    opt_def = optimizers.adam(learning_rate=schedule, honor_learning_rate=True)
    opt = t5x_steps(opt_def.create(params), learning_rate=0.01)
    expected, _ = raw_optax(optax.adam(0.01), params)
    _, scheduled_state = raw_optax(optax.adam(schedule), params)
    assert_close(opt.target, expected)
    # The schedule's own count is still there and advanced, as with raw optax.
    assert jax.tree.structure(opt.state.param_states) == jax.tree.structure(scheduled_state)
    assert int(opt.state.param_states[1].count) == STEPS
    # Without an override the schedule drives the step.
    assert_close(t5x_steps(opt_def.create(params)).target, raw_optax(optax.adam(schedule), params)[0])


def test_only_the_learning_rate_is_overridden_as_in_t5x():
    params = make_params()
    opt = optimizers.adamw(learning_rate=0.01).create(params)
    for name in ("weight_decay", "momentum"):
        with pytest.raises(TypeError, match=rf"\['{name}'\].*\['learning_rate'\]"):
            opt.apply_gradient(grads_at(params, 0), **{name: 0.5})


def test_direct_wrapper_of_an_injected_transformation_honours_the_override():
    params = make_params()
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=1.0)
    opt = t5x_steps(optimizers.OptaxWrapper(tx, honor_learning_rate=True).create(params), learning_rate=0.1)
    assert_close(opt.target, raw_optax(optax.sgd(0.1), params)[0])


def test_direct_wrapper_of_a_plain_transformation_warns_that_the_override_is_ignored():
    params = make_params()
    opt = optimizers.OptaxWrapper(optax.sgd(0.1), honor_learning_rate=True).create(params)
    with pytest.warns(UserWarning, match="no learning rate to set"):
        opt = opt.apply_gradient(grads_at(params, 0), learning_rate=5.0)
    assert_close(opt.target, raw_optax(optax.sgd(0.1), params, steps=1)[0])


# -- T5X's numbers by default: the trainer's learning rate is ignored -----------------------


WRAPPED = ["adam", "adamw", "sgd", "lion", "sm3"]


@pytest.mark.parametrize("name", WRAPPED)
def test_by_default_the_trainers_learning_rate_is_ignored_as_in_t5x(name):
    params = make_params()
    opt = getattr(optimizers, name)(learning_rate=1e-2).create(params)
    with pytest.warns(UserWarning, match="honor_learning_rate=True") as caught:
        opt = t5x_steps(opt, learning_rate=0.5)
    assert len([w for w in caught if "ignored" in str(w.message)]) == 1  # once per optimizer
    expected, expected_state = raw_optax(getattr(optax, name)(1e-2), params)
    assert_close(opt.target, expected)
    assert_close(opt.state.param_states, expected_state)


def test_the_minimal_case_gives_t5x_s_number():
    opt = optimizers.adamw(learning_rate=1e-2, weight_decay=0.0).create({"w": jnp.ones(3)})
    with pytest.warns(UserWarning, match="ignored") as caught:
        opt = opt.apply_gradient({"w": jnp.ones(3)}, learning_rate=0.0)
    assert len(caught) == 1
    np.testing.assert_allclose(opt.target["w"], 0.99, rtol=1e-6)


def test_an_injected_transformation_wrapped_directly_ignores_it_too():
    params = make_params()
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    with pytest.warns(UserWarning, match="honor_learning_rate"):
        opt = t5x_steps(optimizers.OptaxWrapper(tx).create(params), learning_rate=5.0)
    assert_close(opt.target, raw_optax(optax.sgd(0.1), params)[0])


def test_ignored_learning_rates_are_still_checked():
    opt = optimizers.adam(learning_rate=0.1).create(make_params())
    with pytest.raises(TypeError, match="hyperparameter 'learning_rate'"):
        opt.apply_gradient(grads_at(make_params(), 0), learning_rate="0.1")


def test_the_legacy_adafactor_keeps_honouring_it():
    from treeopt.t5x import adafactor

    params = {"w": jnp.ones((3, 2))}
    opt = adafactor.Adafactor(learning_rate=1.0, min_dim_size_to_factor=0).create(params)
    opt = opt.apply_gradient({"w": jnp.ones((3, 2))}, learning_rate=0.1)
    np.testing.assert_allclose(opt.target["w"], 0.9, rtol=1e-6)


def test_update_hyper_params_replaces_or_overrides():
    opt_def = optimizers.adam(learning_rate=0.1, honor_learning_rate=True)
    assert opt_def.hyper_params == optimizers._OptaxWrapperHyperParams(learning_rate=None)
    assert opt_def.update_hyper_params().learning_rate is None
    assert opt_def.update_hyper_params(learning_rate=0.2).learning_rate == 0.2
    replaced = opt_def.hyper_params.replace(learning_rate=0.3)
    assert opt_def.update_hyper_params(hyper_params=replaced).learning_rate == 0.3
    opt = opt_def.create(make_params())
    by_hyper_params = opt.apply_gradient(grads_at(opt.target, 0), hyper_params=replaced)
    by_keyword = opt.apply_gradient(grads_at(opt.target, 0), learning_rate=0.3)
    assert_close(by_hyper_params.target, by_keyword.target)


# -- state dicts and checkpoints ----------------------------------------------------------


def test_adamw_state_dict_has_t5x_shape_and_round_trips():
    params = make_params()
    opt_def = optimizers.adamw(learning_rate=1e-2)
    opt = t5x_steps(opt_def.create(params), steps=2)
    sd = opt.state_dict()
    assert set(sd) == {"target", "state"}
    assert set(sd["state"]) == {"step", "param_states"}
    assert set(sd["state"]["param_states"]) == {"0"}  # the two EmptyStates are dropped
    assert set(sd["state"]["param_states"]["0"]) == {"count", "mu", "nu"}
    assert set(sd["state"]["param_states"]["0"]["mu"]["dense"]) == {"kernel", "bias"}
    fresh = opt_def.create(params)
    restored = fresh.restore_state(jax.tree.map(np.asarray, sd))
    assert jax.tree.structure(restored) == jax.tree.structure(opt)
    assert_close(restored, opt)
    restored = opt.restore_state(opt.state_dict())
    assert jax.tree.structure(restored) == jax.tree.structure(opt)
    assert_close(restored, opt)


def test_restore_state_names_missing_unexpected_and_misshapen_paths():
    params = make_params()
    opt = optimizers.adamw(learning_rate=1e-2).create(params)
    sd = opt.state_dict()
    del sd["state"]["param_states"]["0"]["nu"]["dense"]["kernel"]
    sd["state"]["param_states"]["0"]["mu"]["extra"] = np.zeros(3)
    sd["target"]["out"]["kernel"] = np.zeros((2, 2))
    with pytest.raises(ValueError) as err:
        opt.restore_state(sd)
    message = str(err.value)
    assert isinstance(err.value, treeopt.serialization.StateDictError)
    assert err.value.report.missing == ("state/param_states/0/nu/dense/kernel",)
    assert err.value.report.unexpected == ("state/param_states/0/mu/extra",)
    assert "target/out/kernel: expected float32[4, 2], got float64[2, 2]" in message


def test_masked_nodes_are_dropped_and_restored():
    params = make_params()
    tx = optax.masked(optax.adam(1e-2), treeopt.mask("*kernel"))
    opt = t5x_steps(optimizers.OptaxWrapper(tx).create(params), steps=1)
    sd = opt.state_dict()
    mu = sd["state"]["param_states"]["inner_state"]["0"]["mu"]
    assert set(mu["dense"]) == {"kernel"}  # the bias' MaskedNode is dropped
    restored = opt.restore_state(sd)
    assert jax.tree.structure(restored) == jax.tree.structure(opt)
    assert_close(restored.state, opt.state)


def test_flax_serialization_writes_the_t5x_state_dict():
    params = make_params()
    opt_def = optimizers.adamw(learning_rate=1e-2)
    opt = t5x_steps(opt_def.create(params), steps=1)
    flax_sd = flax.serialization.to_state_dict(opt)
    assert set(flax_sd) == {"target", "state", "checksum"}  # the state dict plus its checksum
    assert set(flax_sd["state"]["param_states"]) == {"0"}
    data = flax.serialization.to_bytes(opt)
    restored = flax.serialization.from_bytes(opt_def.create(params), data)
    assert_close(restored, opt)


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_a_t5x_checkpoint_restores_and_training_continues(name):
    # What T5X writes for adam/adamw after 5 steps: nested target, state/param_states
    # with the ScaleByAdamState under "0" and the EmptyStates left out.
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda p: np.asarray(rng.normal(size=p.shape), np.float32), make_params())
    mu = jax.tree.map(lambda p: np.asarray(rng.normal(size=p.shape) * 0.1, np.float32), params)
    nu = jax.tree.map(lambda p: np.asarray(rng.uniform(size=p.shape) * 0.01, np.float32), params)
    checkpoint = {
        "target": params,
        "state": {"step": np.int32(5), "param_states": {"0": {"count": np.int32(5), "mu": mu, "nu": nu}}},
    }
    factory = getattr(optax, name)
    opt = getattr(optimizers, name)(learning_rate=1e-2).create(jax.tree.map(jnp.zeros_like, params))
    opt = opt.restore_state(checkpoint)
    assert int(opt.state.step) == 5
    opt = t5x_steps(opt)

    tx = factory(1e-2)
    state = tx.init(params)
    state = (optax.ScaleByAdamState(jnp.int32(5), mu, nu), *state[1:])
    expected = jax.tree.map(jnp.asarray, params)
    for i in range(STEPS):
        updates, state = tx.update(grads_at(expected, i), state, expected)
        expected = optax.apply_updates(expected, updates)
    assert int(opt.state.step) == 5 + STEPS
    assert_close(opt.target, expected, rtol=1e-5, atol=1e-6)


# -- logical axes -------------------------------------------------------------------------


def test_adamw_logical_axes_are_shaped_as_t5x_shapes_them():
    params = make_params()
    opt_def = optimizers.adamw(learning_rate=1e-2)
    expected = optimizers.Optimizer(
        opt_def,
        optimizers.OptimizerState(
            None, (optax.ScaleByAdamState(None, AXES, AXES), optax.EmptyState(), optax.EmptyState())
        ),
        AXES,
    )
    assert opt_def.derive_logical_axes(opt_def.create(params), AXES) == expected
    abstract = jax.eval_shape(opt_def.create, params)
    assert opt_def.derive_logical_axes(abstract, AXES) == expected
    assert (
        optimizers.OptaxStatePartitionRules.derive_optax_logical_axes(
            opt_def.create(params).state.param_states, AXES
        )
        == expected.state.param_states
    )


def test_factored_states_get_the_reduced_specs():
    params = {"w": jnp.ones((6, 8))}
    opt_def = optimizers.wrap_optax_optimizer(optax.adafactor)(learning_rate=1e-2, min_dim_size_to_factor=2)
    axes = opt_def.derive_logical_axes(opt_def.create(params), {"w": P("embed", "mlp")})
    factored = axes.state.param_states[0]
    assert factored.count is None
    assert factored.v_row == {"w": P("embed")} and factored.v_col == {"w": P("mlp")}
    assert factored.v == {"w": P()}  # the (1,) placeholder of a factored param

    sm3 = optimizers.sm3(learning_rate=1e-2)
    state = sm3.derive_logical_axes(sm3.create(params), {"w": P("embed", "mlp")}).state.param_states[0]
    assert state.mu == {"w": [P("embed"), P("mlp")]}
    assert state.nu == {"w": P("embed", "mlp")}
    # A square param: only the per-dimension layout tells which vector is which axis.
    square = {"w": jnp.ones((8, 8))}
    state = sm3.derive_logical_axes(sm3.create(square), {"w": P("embed", "mlp")}).state.param_states[0]
    assert state.mu == {"w": [P("embed"), P("mlp")]}


def test_params_without_axes_get_none():
    params = make_params()
    axes = {"dense": {"kernel": P("embed", "mlp"), "bias": None}, "out": {"kernel": P("mlp", "vocab")}}
    opt_def = optimizers.adam(learning_rate=1e-2)
    derived = opt_def.derive_logical_axes(opt_def.create(params), axes).state.param_states[0]
    assert derived.mu == {
        "dense": {"kernel": P("embed", "mlp"), "bias": None},
        "out": {"kernel": P("mlp", "vocab")},
    }


def _parity_transformations():
    from _cases import TRANSFORMATIONS

    return TRANSFORMATIONS


@pytest.mark.parametrize("name", sorted(_parity_transformations()))
def test_logical_axes_derive_for_every_core_parity_transformation(name):
    tx = _parity_transformations()[name]()
    params = make_params()
    opt_def = optimizers.OptaxWrapper(tx)
    opt = jax.eval_shape(opt_def.create, params)
    derived = opt_def.derive_logical_axes(opt, AXES)
    assert derived.state.step is None and derived.target == AXES

    def check(spec, leaf):
        assert spec is None or isinstance(spec, P)
        if isinstance(spec, P):
            assert len(spec) <= len(leaf.shape)

    jax.tree.map(
        check,
        derived.state.param_states,
        opt.state.param_states,
        is_leaf=lambda x: x is None or isinstance(x, P),
    )
    # The T5X classmethod on the raw state, with the params for the shapes.
    by_rules = optimizers.OptaxStatePartitionRules.derive_optax_logical_axes(
        opt.state.param_states, AXES, params=params
    )
    assert jax.tree.structure(by_rules, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(
        derived.state.param_states, is_leaf=lambda x: isinstance(x, P)
    )


# -- MultiOptimizer -----------------------------------------------------------------------


def kernels_and_biases():
    # Built per test: a flax Traversal makes new traversals for every attribute looked up
    # on it, so a module-level one is expensive for pytest's collection to inspect.
    return (
        traverse_util.ModelParamTraversal(lambda path, _: "kernel" in path),
        traverse_util.ModelParamTraversal(lambda path, _: "bias" in path),
    )


def _kernels_and_biases(params):
    flat = traverse_util.flatten_dict(params, sep="/")
    kernels = traverse_util.unflatten_dict({k: v for k, v in flat.items() if "kernel" in k}, sep="/")
    biases = traverse_util.unflatten_dict({k: v for k, v in flat.items() if "bias" in k}, sep="/")
    return kernels, biases


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_multi_optimizer_of_optax_wrappers_matches_raw_optax_per_subset():
    params = make_params()
    kernels_t, biases_t = kernels_and_biases()
    opt_def = optimizers.MultiOptimizer(
        [(kernels_t, optimizers.adam(learning_rate=0.01)), (biases_t, optimizers.adam(learning_rate=0.1))]
    )
    opt = t5x_steps(opt_def.create(params))
    kernels, biases = _kernels_and_biases(params)
    expected_kernels, _ = raw_optax(optax.adam(0.01), kernels)
    expected_biases, _ = raw_optax(optax.adam(0.1), biases)
    got_kernels, got_biases = _kernels_and_biases(opt.target)
    assert_close(got_kernels, expected_kernels)
    assert_close(got_biases, expected_biases)
    # One optax state per sub-optimizer, shaped like its subset.
    assert isinstance(opt.state.param_states, tuple) and len(opt.state.param_states) == 2
    assert set(opt.state.param_states[0][0].mu["dense"]) == {"kernel"}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_multi_optimizer_overrides_per_sub_optimizer_and_skips_unselected_params():
    params = make_params()
    opt_def = optimizers.MultiOptimizer(
        [(kernels_and_biases()[0], optimizers.sgd(learning_rate=1.0, honor_learning_rate=True))]
    )
    opt = opt_def.create(params)
    hparams = opt.optimizer_def.hyper_params
    opt = t5x_steps(opt, hyper_params=[hparams[0].replace(learning_rate=0.1)])
    kernels, _ = _kernels_and_biases(params)
    got_kernels, got_biases = _kernels_and_biases(opt.target)
    assert_close(got_kernels, raw_optax(optax.sgd(0.1), kernels)[0])
    assert_close(got_biases, _kernels_and_biases(params)[1])  # not selected: untouched


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_multi_optimizer_overlap_raises_naming_the_params():
    everything = traverse_util.ModelParamTraversal(lambda path, _: True)
    opt_def = optimizers.MultiOptimizer(
        [
            (kernels_and_biases()[0], optimizers.sgd(learning_rate=0.1)),
            (everything, optimizers.sgd(learning_rate=0.1)),
        ]
    )
    with pytest.raises(ValueError, match=r"same leaves: 'dense/kernel' \(traversals \[0, 1\]\)"):
        opt_def.create(make_params())


def test_multi_optimizer_rejects_what_is_not_a_traversal_pair():
    with pytest.raises(TypeError, match=r"entry 0 is \('kernel'"):
        optimizers.MultiOptimizer([("kernel", optimizers.sgd(learning_rate=0.1))])
    with pytest.raises(TypeError):  # T5X's signature: one sequence of pairs
        optimizers.MultiOptimizer(*[(kernels_and_biases()[0], optimizers.sgd(learning_rate=0.1))] * 2)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_multi_optimizer_state_dict_round_trip_and_logical_axes():
    params = make_params()
    kernels_t, biases_t = kernels_and_biases()
    opt_def = optimizers.MultiOptimizer(
        [
            (kernels_t, optimizers.adamw(learning_rate=0.01)),
            (biases_t, optimizers.sgd(learning_rate=0.1, momentum=0.9)),
        ]
    )
    opt = t5x_steps(opt_def.create(params), steps=2)
    sd = opt.state_dict()
    assert set(sd["state"]["param_states"]) == {"0", "1"}
    assert set(sd["state"]["param_states"]["0"]) == {"0"}  # adamw's EmptyStates dropped
    restored = opt_def.create(params).restore_state(jax.tree.map(np.asarray, sd))
    assert jax.tree.structure(restored) == jax.tree.structure(opt)
    assert_close(restored, opt)
    assert_close(t5x_steps(restored, steps=1), t5x_steps(opt, steps=1))

    axes = opt_def.derive_logical_axes(jax.eval_shape(opt_def.create, params), AXES)
    kernel_axes = {"dense": {"kernel": P("embed", "mlp")}, "out": {"kernel": P("mlp", "vocab")}}
    assert axes.state.step is None and axes.target == AXES
    assert axes.state.param_states[0][0] == optax.ScaleByAdamState(None, kernel_axes, kernel_axes)
    assert axes.state.param_states[1][0].trace == {"dense": {"bias": P("mlp")}}
    opt_def.set_param_axes(AXES)  # no sub-optimizer takes axes here: a no-op that must not fail


def test_optax_wrapper_needs_a_transformation():
    with pytest.raises(TypeError, match="wrap_optax_optimizer"):
        optimizers.OptaxWrapper(optax.adam)


def test_rng_keys_are_written_as_key_data_and_restored_as_keys():
    params = make_params()
    opt_def = optimizers.noisy_sgd(learning_rate=1e-2, key=jax.random.key(3))
    opt = t5x_steps(opt_def.create(params), steps=1)
    data = flax.serialization.to_bytes(opt)  # msgpack: no typed keys in the state dict
    restored = flax.serialization.from_bytes(opt_def.create(params), data)
    assert jax.dtypes.issubdtype(restored.state.param_states[0].rng_key.dtype, jax.dtypes.prng_key)
    assert_close(t5x_steps(restored, steps=1).target, t5x_steps(opt, steps=1).target)


def test_a_t5x_style_definition_of_your_own_works():
    @flax.struct.dataclass
    class HyperParams:
        learning_rate: float
        beta: float

    class Momentum(optimizers.OptimizerDef):
        def init_state(self, params):
            return optimizers.OptimizerState(jnp.asarray(0), jax.tree.map(jnp.zeros_like, params))

        def apply_gradient(self, hyper_params, params, state, grads):
            traces = jax.tree.map(lambda t, g: hyper_params.beta * t + g, state.param_states, grads)
            new = jax.tree.map(lambda p, t: p - hyper_params.learning_rate * t, params, traces)
            return new, optimizers.OptimizerState(state.step + 1, traces)

    params = make_params()
    opt_def = Momentum(HyperParams(0.1, 0.9))
    opt = t5x_steps(opt_def.create(params), learning_rate=0.01)
    assert_close(opt.target, raw_optax(optax.sgd(0.01, momentum=0.9), params)[0])
    restored = opt_def.create(params).restore_state(opt.state_dict())
    assert_close(restored, opt)
    with pytest.raises(TypeError):  # not a field of its hyper params, as with T5X
        opt.apply_gradient(grads_at(params, 0), momentum=0.5)
    # T5X's base class: no axes or factor-rule hooks unless a definition has them.
    assert not hasattr(opt_def, "derive_logical_axes") and not hasattr(opt_def, "set_param_axes")
