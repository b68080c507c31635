"""The legacy Adafactor of treeopt.t5x: T5X's shapes, numbers, errors and checkpoint layout.

Exact numbers come from T5X's documented behaviour (rtol=1e-6). Where optax's
``adafactor`` implements the same algorithm (default options, momentum, weight
decay), several steps of both agree to float rounding (rtol=1e-6, atol=1e-7).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from treeopt.t5x import (
    Adafactor,
    AdafactorParamState,
    FactorDim,
    HParamMap,
    MultiOptimizer,
    OptimizerState,
    factor_name_to_factordim,
    legacy_adafactor,
    standard_logical_factor_rules,
)

RTOL = 1e-6


def state_of(opt_def, shape, path="w"):
    return opt_def.create({path: jnp.ones(shape)}).state.param_states[path]


def shapes(state):
    return state.v_row.shape, state.v_col.shape, state.v.shape, state.m.shape


# -- state shapes ---------------------------------------------------------------------


def test_heuristic_factors_a_matrix_over_its_two_largest_dims():
    assert shapes(state_of(Adafactor(0.1, min_dim_size_to_factor=8), (24, 16))) == ((16,), (24,), (1,), (1,))
    assert shapes(state_of(Adafactor(0.1, min_dim_size_to_factor=32), (24, 16))) == (
        (1,),
        (1,),
        (24, 16),
        (1,),
    )
    factored = state_of(Adafactor(0.1, min_dim_size_to_factor=32), (64, 64))
    assert factored.v_row.shape == (64,) and factored.v_col.shape == (64,) and factored.v.shape == (1,)
    assert state_of(Adafactor(0.1, min_dim_size_to_factor=32), (31, 64)).v.shape == (31, 64)
    assert state_of(Adafactor(0.1, factored=False, min_dim_size_to_factor=1), (24, 16)).v.shape == (24, 16)
    assert state_of(Adafactor(0.1, min_dim_size_to_factor=1), (5,)).v.shape == (5,)


def test_momentum_slot_and_its_dtype():
    state = state_of(
        Adafactor(0.1, beta1=0.9, dtype_momentum=jnp.bfloat16, min_dim_size_to_factor=8), (24, 16)
    )
    assert state.m.shape == (24, 16) and state.m.dtype == jnp.bfloat16
    assert state.v_row.dtype == jnp.float32


def test_explicit_rule_for_rank_three():
    opt_def = Adafactor(
        0.1, factor_map=HParamMap([("w", (FactorDim.COLUMN, FactorDim.BATCH, FactorDim.ROW))])
    )
    assert shapes(state_of(opt_def, (24, 4, 16))) == ((4, 16), (24, 4), (1,), (1,))
    by_name = Adafactor(0.1, factor_map=HParamMap([("w", ("column", "batch", "row"))]))
    assert shapes(state_of(by_name, (24, 4, 16))) == ((4, 16), (24, 4), (1,), (1,))
    # A rule without both a ROW and a COLUMN dim leaves the param unfactored.
    unfactored = Adafactor(0.1, factor_map=HParamMap([("w", ("column", "none"))]))
    assert state_of(unfactored, (24, 16)).v.shape == (24, 16)


def test_errors_as_in_t5x():
    with pytest.raises(ValueError, match=r"'w' has shape \(24, 4, 16\); a parameter of rank > 2 needs"):
        Adafactor(0.1).create({"w": jnp.ones((24, 4, 16))})
    with pytest.raises(ValueError, match=r"rule .* of parameter 'w' has 2 entries"):
        Adafactor(0.1, factor_map=HParamMap([("w", ("row", "column"))])).create({"w": jnp.ones((2, 3, 4))})
    with pytest.raises(KeyError, match="No HParamMap rule matches parameter 'w'"):
        Adafactor(0.1, factor_map=HParamMap([("kernel", ("row", "column"))])).create({"w": jnp.ones((2, 3))})
    with pytest.raises(ValueError, match="factored=False, but a factor_map"):
        Adafactor(0.1, factored=False, factor_map=HParamMap([]))
    with pytest.raises(TypeError, match="multiply_by_parameter_scale must be"):
        Adafactor(0.1, multiply_by_parameter_scale="yes")
    with pytest.raises(TypeError, match="factor_map must be None or an HParamMap"):
        Adafactor(0.1, factor_map={"w": ("row", "column")})
    opt = Adafactor().create({"w": jnp.ones(3)})
    with pytest.raises(ValueError, match="no learning rate"):
        opt.apply_gradient({"w": jnp.ones(3)})
    with pytest.raises(ValueError, match="Unknown factor dimension"):
        factor_name_to_factordim("diagonal")


def test_hparam_map_first_match_wins():
    hp = HParamMap([("bias$", 0.0), ("dense/.*", 1.0), (".*", 2.0)])
    assert hp["dense/bias"] == 0.0 and hp["dense/kernel"] == 1.0 and hp["out/kernel"] == 2.0
    assert hp({"dense": {"kernel": 1, "bias": 2}}) == {"dense": {"kernel": 1.0, "bias": 0.0}}
    with pytest.raises(KeyError):
        HParamMap([("a", 1)])["b"]


def test_standard_logical_factor_rules():
    rules = standard_logical_factor_rules()
    assert rules["vocab"] is FactorDim.COLUMN and rules["embed"] is FactorDim.ROW
    assert rules["layers"] is FactorDim.BATCH and rules["relpos_buckets"] is FactorDim.NONE


# -- numbers ------------------------------------------------------------------------------


def one_step(opt_def, param_state, step=1):
    opt = opt_def.create({"x": jnp.ones((3, 2))})
    opt = opt.replace(state=OptimizerState(jnp.asarray(step, jnp.int32), {"x": param_state}))
    return opt.apply_gradient({"x": jnp.ones((3, 2))})


def test_factored_step_numbers():
    opt_def = Adafactor(learning_rate=0.1, decay_rate=0.8, min_dim_size_to_factor=0)
    start = AdafactorParamState(jnp.array([0.9, 0.9]), jnp.array([0.1, 0.1, 0.1]), jnp.zeros(1), jnp.zeros(1))
    opt = one_step(opt_def, start)
    state = opt.state.param_states["x"]
    assert int(opt.state.step) == 2
    np.testing.assert_allclose(state.v_row, np.full(2, 0.9574349), rtol=RTOL)
    np.testing.assert_allclose(state.v_col, np.full(3, 0.6169143), rtol=RTOL)
    np.testing.assert_allclose(opt.target["x"], np.full((3, 2), 0.9), rtol=RTOL)
    assert state.v.shape == (1,) and state.m.shape == (1,)


def test_unfactored_step_numbers():
    opt_def = Adafactor(learning_rate=0.1, decay_rate=0.8, beta1=0.0, min_dim_size_to_factor=32)
    start = AdafactorParamState(jnp.zeros(1), jnp.zeros(1), jnp.full((3, 2), 0.5), jnp.zeros((3, 2)))
    opt = one_step(opt_def, start)
    state = opt.state.param_states["x"]
    np.testing.assert_allclose(state.v, np.full((3, 2), 0.787174), rtol=RTOL)
    np.testing.assert_allclose(state.m, np.full((3, 2), 0.1), rtol=RTOL)
    np.testing.assert_allclose(opt.target["x"], np.full((3, 2), 0.9), rtol=RTOL)


def test_global_norm_clipping_numbers():
    opt_def = Adafactor(
        learning_rate=0.1, decay_rate=0.8, min_dim_size_to_factor=0, global_norm_clip_threshold=1.0
    )
    start = AdafactorParamState(jnp.array([0.9, 0.9]), jnp.array([0.1, 0.1, 0.1]), jnp.zeros(1), jnp.zeros(1))
    state = one_step(opt_def, start).state.param_states["x"]
    np.testing.assert_allclose(state.v_row, np.full(2, 0.478811), rtol=RTOL)
    np.testing.assert_allclose(state.v_col, np.full(3, 0.13829), rtol=RTOL)


def params_and_grads():
    params = {
        "dense": {"kernel": jnp.linspace(-1.0, 1.0, 24).reshape(6, 4), "bias": jnp.linspace(0.1, 0.6, 4)},
        "out": {"kernel": jnp.linspace(0.5, -0.5, 8).reshape(4, 2)},
    }
    return params, lambda p, i: jax.tree.map(lambda x: jnp.cos(x * (i + 1.0)) + 0.1 * x, p)


def run_legacy(opt_def, params, grads_fn, steps=3, **overrides):
    opt = opt_def.create(params)
    for i in range(steps):
        opt = opt.apply_gradient(grads_fn(opt.target, i), **overrides)
    return opt


def run_optax(tx, params, grads_fn, steps=3):
    @jax.jit
    def step(params, state, i):
        updates, state = tx.update(grads_fn(params, i), state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    for i in range(steps):
        params, state = step(params, state, i)
    return params


@pytest.mark.parametrize(
    "legacy, raw",
    [
        (dict(min_dim_size_to_factor=2), dict(min_dim_size_to_factor=2)),
        (dict(min_dim_size_to_factor=128), dict(min_dim_size_to_factor=128)),
        (
            dict(min_dim_size_to_factor=2, beta1=0.9, weight_decay_rate=0.01),
            dict(min_dim_size_to_factor=2, momentum=0.9, weight_decay_rate=0.01),
        ),
    ],
    ids=["factored", "unfactored", "momentum_and_weight_decay"],
)
def test_several_steps_agree_with_optax_adafactor(legacy, raw):
    params, grads_fn = params_and_grads()
    opt = run_legacy(Adafactor(learning_rate=0.05, **legacy), params, grads_fn)
    expected = run_optax(optax.adafactor(0.05, **raw), params, grads_fn)
    for a, e in zip(jax.tree.leaves(opt.target), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7)


def test_learning_rate_override_equals_the_constructor_value():
    params, grads_fn = params_and_grads()
    built = run_legacy(Adafactor(learning_rate=0.05, min_dim_size_to_factor=2), params, grads_fn)
    overridden = run_legacy(Adafactor(min_dim_size_to_factor=2), params, grads_fn, learning_rate=0.05)
    for a, e in zip(jax.tree.leaves(overridden), jax.tree.leaves(built), strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-7)


def test_other_options_change_the_step_as_documented():
    params, grads_fn = params_and_grads()
    base = run_legacy(Adafactor(learning_rate=0.05, min_dim_size_to_factor=2), params, grads_fn, steps=1)
    capped = run_legacy(
        Adafactor(learning_rate=0.05, min_dim_size_to_factor=2, max_parameter_scale=0.1),
        params,
        grads_fn,
        steps=1,
    )
    # The parameter scale of dense/kernel is its RMS (~0.62); capped at 0.1 the step shrinks.
    step = np.abs(np.asarray(params["dense"]["kernel"] - base.target["dense"]["kernel"]))
    capped_step = np.abs(np.asarray(params["dense"]["kernel"] - capped.target["dense"]["kernel"]))
    rms = float(jnp.sqrt(jnp.mean(params["dense"]["kernel"] ** 2)))
    np.testing.assert_allclose(capped_step, step * 0.1 / rms, rtol=1e-5)

    exponent = run_legacy(
        Adafactor(learning_rate=0.05, min_dim_size_to_factor=2, weight_decay_rate_lr_exponent=1.0),
        params,
        grads_fn,
        steps=1,
    )
    decayed = run_legacy(
        Adafactor(learning_rate=0.05, min_dim_size_to_factor=2, weight_decay_rate=0.05),
        params,
        grads_fn,
        steps=1,
    )
    for a, e in zip(jax.tree.leaves(exponent.target), jax.tree.leaves(decayed.target), strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-6)


def test_skip_nan_updates_keeps_param_and_state():
    opt_def = Adafactor(learning_rate=0.1, min_dim_size_to_factor=2, skip_nan_updates=True)
    opt = opt_def.create({"w": jnp.ones((4, 4)), "b": jnp.ones(4)})
    new = opt.apply_gradient({"w": jnp.full((4, 4), jnp.nan), "b": jnp.ones(4)})
    np.testing.assert_array_equal(new.target["w"], opt.target["w"])
    np.testing.assert_array_equal(new.state.param_states["w"].v_row, opt.state.param_states["w"].v_row)
    assert not np.allclose(new.target["b"], opt.target["b"])


# -- checkpoints, MultiOptimizer, logical axes ---------------------------------------------


def test_checkpoint_layout_and_restore():
    params, grads_fn = params_and_grads()
    opt_def = Adafactor(learning_rate=0.05, min_dim_size_to_factor=2, beta1=0.9)
    opt = run_legacy(opt_def, params, grads_fn, steps=2)
    sd = opt.state_dict()
    entry = sd["state"]["param_states"]["dense"]["kernel"]
    assert set(entry) == {"v_row", "v_col", "v", "m"}
    assert entry["v_row"].shape == (4,) and entry["v_col"].shape == (6,) and entry["v"].shape == (1,)
    restored = opt_def.create(params).restore_state(jax.tree.map(np.asarray, sd))
    for a, e in zip(jax.tree.leaves(restored), jax.tree.leaves(opt), strict=True):
        np.testing.assert_array_equal(a, e)
    bad = jax.tree.map(np.asarray, sd)
    bad["state"]["param_states"]["dense"]["kernel"]["v_row"] = np.zeros(6)
    with pytest.raises(ValueError, match="'state/param_states/dense/kernel/v_row': expected shape"):
        opt.restore_state(bad)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_multi_optimizer_of_two_adafactors_equals_one_with_an_hparam_map():
    params, grads_fn = params_and_grads()
    kernels = traverse_util.ModelParamTraversal(lambda path, _: "kernel" in path)
    biases = traverse_util.ModelParamTraversal(lambda path, _: "bias" in path)
    multi = MultiOptimizer(
        (kernels, Adafactor(learning_rate=0.05, min_dim_size_to_factor=2)),
        (biases, Adafactor(learning_rate=0.05, min_dim_size_to_factor=2, multiply_by_parameter_scale=False)),
    )
    single = Adafactor(
        learning_rate=0.05,
        min_dim_size_to_factor=2,
        multiply_by_parameter_scale=HParamMap([("bias", False), (".*", True)]),
    )
    a = run_legacy(multi, params, grads_fn)
    b = run_legacy(single, params, grads_fn)
    assert jax.tree.structure(a.state.param_states) == jax.tree.structure(b.state.param_states)
    for x, y in zip(jax.tree.leaves((a.target, a.state)), jax.tree.leaves((b.target, b.state)), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-7)
    # T5X's layout: the per-parameter states shaped like the target.
    assert set(a.state_dict()["state"]["param_states"]["dense"]["kernel"]) == {"v_row", "v_col", "v", "m"}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_multi_optimizer_leaves_unselected_params_without_state_and_passes_axes():
    params = {"dense": {"kernel": jnp.ones((2, 3, 4)), "bias": jnp.ones(4)}}
    axes = {"dense": {"kernel": P("layers", "embed", "mlp"), "bias": P("mlp")}}
    kernels = traverse_util.ModelParamTraversal(lambda path, _: "kernel" in path)
    sub = Adafactor(0.1, logical_factor_rules=standard_logical_factor_rules())
    multi = MultiOptimizer((kernels, sub))
    multi.set_param_axes(axes)  # the sub-optimizer sees the kernel's full name
    opt = multi.create(params)
    assert opt.state.param_states["dense"]["bias"] is None
    assert opt.state.param_states["dense"]["kernel"].v_row.shape == (2, 3)
    derived = multi.derive_logical_axes(opt, axes).state.param_states
    assert derived["dense"]["bias"] is None
    assert derived["dense"]["kernel"].v_col == P("layers", "mlp")


def test_set_param_axes_and_derived_axes():
    opt_def = Adafactor(0.1, beta1=0.9, logical_factor_rules=standard_logical_factor_rules())
    params = {
        "wi": jnp.ones((2, 8, 12)),
        "embedding": jnp.ones((16, 8)),
        "scale": jnp.ones(8),
        "relpos": jnp.ones((4, 32)),
    }
    axes = {
        "wi": P("layers", "embed", "mlp"),
        "embedding": P("vocab", "embed"),
        "scale": P("embed"),
        "relpos": P("heads", "relpos_buckets"),
    }
    opt_def.set_param_axes(axes)
    assert opt_def.hyper_params.factor_map["wi"] == (FactorDim.BATCH, FactorDim.ROW, FactorDim.COLUMN)
    opt = opt_def.create(params)
    derived = opt_def.derive_logical_axes(jax.eval_shape(opt_def.create, params), axes)
    assert derived.state.step is None and derived.target == axes
    states = derived.state.param_states
    assert states["wi"] == AdafactorParamState(
        P("layers", "embed"), P("layers", "mlp"), P(), P("layers", "embed", "mlp")
    )
    assert states["embedding"] == AdafactorParamState(P("embed"), P("vocab"), P(), P("vocab", "embed"))
    assert states["scale"] == AdafactorParamState(P(), P(), P("embed"), P("embed"))
    assert states["relpos"] == AdafactorParamState(
        P(), P(), P("heads", "relpos_buckets"), P("heads", "relpos_buckets")
    )
    # Each spec has one entry per axis of the state leaf it describes.
    for spec, leaf in zip(jax.tree.leaves(states), jax.tree.leaves(opt.state.param_states), strict=True):
        assert len(spec) <= leaf.ndim
    assert legacy_adafactor.Adafactor is Adafactor
