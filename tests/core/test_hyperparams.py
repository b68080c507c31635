"""Runtime hyperparameters and the one-trace guarantee."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import grads_at

import treeopt

PARAMS = {"dense": {"kernel": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "bias": jnp.ones(3)}}


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


def two_labels_opt():
    """``learning_rate`` injected twice: 0.1 for the kernel (label ``decay``), 0.2 for the rest (``plain``)."""
    tx = optax.multi_transform(
        {
            "decay": optax.inject_hyperparams(optax.adamw)(learning_rate=0.1),
            "plain": optax.inject_hyperparams(optax.sgd)(learning_rate=0.2),
        },
        treeopt.labels({"*kernel": "decay"}, default="plain"),
    )
    return treeopt.Optimizer(tx).init(PARAMS)


def test_repeated_names_are_qualified_by_label():
    opt = two_labels_opt()
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


# -- setting a value: checked, never truncated, never the caller's buffer ------------------


def sgd_opt(**hyperparams):
    return treeopt.Optimizer(optax.inject_hyperparams(optax.sgd)(**hyperparams)).init(PARAMS)


def test_integer_hyperparameter_set_to_a_float_is_promoted_not_truncated():
    opt = sgd_opt(learning_rate=1)
    assert jnp.issubdtype(opt.learning_rate.dtype, jnp.integer)
    opt.learning_rate = 0.5
    assert opt.learning_rate.dtype == jnp.float32 and opt.learning_rate.shape == ()
    assert float(opt.learning_rate) == 0.5
    grads = grads_at(PARAMS, 0)
    new = opt.update(grads, PARAMS)
    expected = jax.tree.map(lambda p, g: p - 0.5 * g, PARAMS, grads)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    opt.learning_rate = 2  # an integer again: it stays a float, exactly
    assert opt.learning_rate.dtype == jnp.float32 and float(opt.learning_rate) == 2.0


def test_weight_decay_built_as_zero_then_set_to_a_small_float():
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=0.1, weight_decay=0)
    opt = treeopt.Optimizer(tx).init(PARAMS)
    opt.weight_decay = 1e-2
    assert float(opt.weight_decay) == pytest.approx(1e-2)


def test_integer_hyperparameter_keeps_its_dtype_for_integers_in_range_and_refuses_others():
    opt = sgd_opt(learning_rate=1)
    dtype = opt.learning_rate.dtype
    opt.learning_rate = 3
    assert opt.learning_rate.dtype == dtype and int(opt.learning_rate) == 3
    with pytest.raises(ValueError, match=r"'learning_rate' \(int32\[\]\): expected a value in the int32 range"):
        opt.learning_rate = 2**40
    with pytest.raises(ValueError, match=r"'learning_rate'.*int32 range.*got int 1180591620717411303424"):
        opt.learning_rate = 2**70
    assert int(opt.learning_rate) == 3


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (None, TypeError, "expected a real number, got None"),
        ("0.1", TypeError, r"expected a real number, got the string .0\.1."),
        (True, TypeError, "expected a real number, got bool True"),
        (np.bool_(False), TypeError, "expected a real number, got bool"),
        (1j, TypeError, r"expected a real number \(complex values are not hyperparameters\), got complex 1j"),
        (jnp.asarray(0.5 + 1j), TypeError, r"expected a real number .*, got complex64\[\]"),
        (float("nan"), ValueError, "expected a finite number, got float nan"),
        (float("inf"), ValueError, "expected a finite number, got float inf"),
        (np.float32(-np.inf), ValueError, "expected a finite number, got float32 "),
        (jnp.asarray(jnp.nan), ValueError, r"expected a finite number, got float32\[\]"),
        (jnp.ones(3), ValueError, r"expected a scalar, got float32\[3\]"),
        ([0.1], ValueError, r"expected a scalar, got list \[0.1\]"),
        (1e40, ValueError, r"expected a value in the float32 range \[-3.40282e\+38, 3.40282e\+38\], got float 1e\+40"),
        (object(), TypeError, "expected a real number, got object"),
    ],
    ids=lambda v: None if isinstance(v, (type, str)) else repr(v)[:20],
)
def test_invalid_values_are_refused_naming_the_hyperparameter(value, error, message):
    opt = sgd_opt(learning_rate=0.1)
    before = opt.opt_state
    with pytest.raises(error, match=r"^Cannot set hyperparameter 'learning_rate' \(float32\[\]\): " + message):
        opt.learning_rate = value
    assert opt.opt_state is before


def test_refusals_name_the_qualified_hyperparameter():
    opt = two_labels_opt()
    with pytest.raises(TypeError, match=r"Cannot set hyperparameter 'decay/learning_rate' .* got None"):
        opt.set_hyperparams({"decay/learning_rate": None})
    with pytest.raises(ValueError, match=r"'plain/learning_rate' .*finite.* got float nan"):
        opt.set_hyperparams({"plain/learning_rate": float("nan")})


def test_a_hyperparameter_array_takes_a_scalar_or_exactly_its_shape():
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=jnp.full((2,), 0.1))
    state = tx.init(PARAMS)
    new = treeopt.set_hyperparams(state, {"learning_rate": 0.5})
    np.testing.assert_array_equal(treeopt.get_hyperparams(new)["learning_rate"], [0.5, 0.5])
    new = treeopt.set_hyperparams(state, {"learning_rate": np.array([0.25, 0.75])})
    got = treeopt.get_hyperparams(new)["learning_rate"]
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, [0.25, 0.75])
    with pytest.raises(
        ValueError, match=r"\(float32\[2\]\): expected a scalar or a float32\[2\] array, got float64\[3\]"
    ):
        treeopt.set_hyperparams(state, {"learning_rate": np.ones(3)})


def test_the_stored_value_is_a_copy_so_donating_the_optimizer_keeps_the_callers_array():
    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, opt):
        return opt.update(grads_at(params, 0), params), opt

    base_lr = jnp.array(0.01, jnp.float32)  # same dtype and shape as the state's value
    opt = sgd_opt(learning_rate=0.1)
    opt.learning_rate = base_lr
    assert opt.learning_rate.unsafe_buffer_pointer() != base_lr.unsafe_buffer_pointer()
    params, opt = step(PARAMS, opt)
    assert not base_lr.is_deleted()
    assert float(base_lr) == pytest.approx(0.01)
    opt.learning_rate = base_lr * 2
    params, opt = step(params, opt)
    assert float(opt.learning_rate) == pytest.approx(0.02)


def test_floats_keep_the_aval_weak_types_included_so_nothing_retraces():
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=1)  # optax stores a weakly typed int32
    state = tx.init(PARAMS)
    traces = 0

    @jax.jit
    def step(state):
        nonlocal traces
        traces += 1
        return tx.update(grads_at(PARAMS, 0), state, PARAMS)

    step(state)
    for value in (2, np.int32(3), jnp.asarray(4)):
        state = treeopt.set_hyperparams(state, {"learning_rate": value})
        step(state)
    assert traces == 1
    # A weakly typed float (as a hand-built state may hold) stays weakly typed too.
    weak = jnp.asarray(0.1)
    inner = state._replace(hyperparams={"learning_rate": weak})
    new = treeopt.set_hyperparams(inner, {"learning_rate": 0.2})
    lr = treeopt.get_hyperparams(new)["learning_rate"]
    assert lr.weak_type and lr.dtype == weak.dtype and float(lr) == pytest.approx(0.2)


def test_setting_every_hyperparameter_of_a_built_optimizer_compiles_once():
    traces = 0

    @jax.jit
    def step(params, opt):
        nonlocal traces
        traces += 1
        return opt.update(grads_at(params, 0), params), opt

    opt = treeopt.Optimizer(optax.inject_hyperparams(optax.adam)(learning_rate=1, b1=0.9)).init(PARAMS)
    params = PARAMS
    params, opt = step(params, opt)
    for value in (2, np.int64(3), jnp.asarray(4, jnp.int32)):
        opt.learning_rate = value
        opt.b1 = jnp.asarray(0.5)  # weakly typed: the state's value stays strong
        opt.eps = jnp.float32(1e-6)
        opt.b2 = np.float64(0.99)
        params, opt = step(params, opt)
    assert traces == 1


# -- hyperparameters that come from a schedule ---------------------------------------------


def test_setting_a_scheduled_hyperparameter_is_refused_with_the_way_out():
    schedule = optax.linear_schedule(1.0, 0.0, 10)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule, momentum=0.5)
    params = {"w": jnp.ones(2)}
    opt = treeopt.Optimizer(tx).init(params)
    assert opt.hyperparams.scheduled == frozenset({"learning_rate"})
    assert "(from a schedule)" in repr(opt.hyperparams)
    with pytest.raises(ValueError, match=r"'learning_rate': it comes from a schedule") as err:
        opt.learning_rate = 5.0
    assert "step_size" in str(err.value) and "learning_rate=1e-3" in str(err.value)
    # Refused before anything changed; the plain hyperparameter beside it can still be set.
    opt.momentum = 0.25
    params = opt.update({"w": jnp.ones(2)}, params)
    np.testing.assert_allclose(params["w"], 0.0)  # the schedule's first rate, 1.0
    assert float(opt.hyperparams["momentum"]) == 0.25


def test_a_schedule_scaled_by_an_injected_factor_is_the_documented_override():
    schedule = optax.linear_schedule(1.0, 0.0, 10)
    tx = optax.chain(optax.sgd(schedule), optax.inject_hyperparams(optax.scale)(step_size=1.0))
    params = {"w": jnp.zeros(2)}
    opt = treeopt.Optimizer(tx).init(params)
    assert opt.hyperparams.scheduled == frozenset()
    opt.step_size = 0.5
    params = opt.update({"w": jnp.ones(2)}, params)
    np.testing.assert_allclose(params["w"], -0.5)


def test_scheduled_hyperparameters_are_named_by_qualified_name():
    schedule = optax.constant_schedule(0.1)
    tx = optax.multi_transform(
        {
            "a": optax.inject_hyperparams(optax.sgd)(learning_rate=schedule),
            "b": optax.inject_hyperparams(optax.sgd)(learning_rate=0.2),
        },
        {"x": "a", "y": "b"},
    )
    state = tx.init({"x": jnp.ones(1), "y": jnp.ones(1)})
    hp = treeopt.get_hyperparams(state)
    assert hp.scheduled == frozenset({"a/learning_rate"})
    with pytest.raises(ValueError, match="'a/learning_rate': it comes from a schedule"):
        treeopt.set_hyperparams(state, {"a/learning_rate": 0.3})
    new = treeopt.set_hyperparams(state, {"b/learning_rate": 0.3})
    assert float(treeopt.get_hyperparams(new)["b/learning_rate"]) == pytest.approx(0.3)
