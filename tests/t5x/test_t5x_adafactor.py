"""treeopt.t5x.adafactor, T5X's legacy Adafactor: its numbers, options, checkpoints and compiled step.

Exact numbers are small hand-worked cases (uniform gradients, where every
factor of the update is a round number). Where optax's ``adafactor``
implements the same algorithm (default options, momentum, weight decay),
several steps of both agree to float rounding. How parameters are factored is
in ``test_t5x_adafactor_rules.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from treeopt.t5x import _adafactor_step as adafactor_step
from treeopt.t5x import adafactor
from treeopt.t5x.adafactor import Adafactor, FactorDim, HParamMap, _AdafactorParamState
from treeopt.t5x.optimizers import MultiOptimizer, OptimizerState

from _helpers import assert_trees_close


def test_import_prefix_is_the_only_change():
    import treeopt.t5x

    assert treeopt.t5x.adafactor is adafactor
    for name in (
        "Adafactor", "FactorDim", "HParamMap", "HEURISTIC_RULE", "HeuristicRule", "FactorRule", "Dtype",
        "standard_logical_factor_rules", "factor_name_to_factordim", "_AdafactorHyperParams",
        "_AdafactorParamState",
    ):  # fmt: skip
        assert hasattr(adafactor, name), name


# -- hand-worked steps ----------------------------------------------------------------------
# At step 0 the decay 1 - (0 + 1) ** -0.8 is 0: the statistics are this step's squared
# gradients. With a uniform gradient g the normalized update is 1 everywhere (RMS 1: no
# clipping) and the step is learning_rate * RMS(param).


def test_first_factored_step():
    opt_def = Adafactor(learning_rate=0.1, min_dim_size_to_factor=0)
    opt = opt_def.create({"x": jnp.full((4, 2), 2.0)})
    opt = opt.apply_gradient({"x": jnp.full((4, 2), 0.5)})
    state = opt.state.param_states["x"]
    np.testing.assert_allclose(state.v_row, [0.25, 0.25], rtol=1e-6)  # (4, 2): v_row keeps axis 1
    np.testing.assert_allclose(state.v_col, [0.25] * 4, rtol=1e-6)
    np.testing.assert_allclose(opt.target["x"], np.full((4, 2), 1.8), rtol=1e-6)  # 2 - 0.1 * 2
    assert int(opt.state.step) == 1 and state.v.shape == (1,) and state.m.shape == (1,)
    # Step 1 decays by 1 - 2 ** -0.8; the same gradient keeps the statistics at 0.25.
    opt = opt.apply_gradient({"x": jnp.full((4, 2), 0.5)})
    np.testing.assert_allclose(opt.state.param_states["x"].v_row, [0.25, 0.25], rtol=1e-6)
    np.testing.assert_allclose(opt.target["x"], np.full((4, 2), 1.62), rtol=1e-6)  # 1.8 - 0.1 * 1.8


def test_first_unfactored_step_with_momentum():
    opt_def = Adafactor(learning_rate=0.1, beta1=0.5)
    opt = opt_def.create({"b": jnp.ones(3)}).apply_gradient({"b": jnp.full(3, 2.0)})
    state = opt.state.param_states["b"]
    np.testing.assert_allclose(state.v, [4.0] * 3, rtol=1e-6)
    np.testing.assert_allclose(state.m, [0.05] * 3, rtol=1e-6)  # 0.5 * 0 + 0.5 * (0.1 * 1 * 1)
    np.testing.assert_allclose(opt.target["b"], [0.95] * 3, rtol=1e-6)


def test_decay_schedule_and_step_offset():
    np.testing.assert_allclose(Adafactor._decay_rate_pow(3, exponent=0.5), 0.5, rtol=1e-6)  # 1 - 4 ** -0.5
    # With step_offset=10 a state at step 10 decays as a fresh one: v is this step's g ** 2.
    opt_def = Adafactor(learning_rate=0.1, step_offset=10)
    state = OptimizerState(
        jnp.asarray(10),
        {"b": _AdafactorParamState(jnp.zeros(1), jnp.zeros(1), jnp.full(2, 9.0), jnp.zeros(1))},
    )
    _, new_state = opt_def.apply_gradient(
        opt_def.hyper_params, {"b": jnp.ones(2)}, state, {"b": jnp.full(2, 3.0)}
    )
    np.testing.assert_allclose(new_state.param_states["b"].v, [9.0, 9.0], rtol=1e-6)
    assert int(new_state.step) == 11


def test_global_norm_clipping():
    # Gradients of global norm sqrt(4 * 9) = 6, clipped to 3: halved to 1.5, squared 2.25.
    opt_def = Adafactor(learning_rate=0.1, min_dim_size_to_factor=0, global_norm_clip_threshold=3.0)
    opt = opt_def.create({"x": jnp.ones((2, 2))}).apply_gradient({"x": jnp.full((2, 2), 3.0)})
    np.testing.assert_allclose(opt.state.param_states["x"].v_row, [2.25, 2.25], rtol=1e-6)
    # A threshold of 0 is off, as T5X tests it for truth.
    off = Adafactor(learning_rate=0.1, min_dim_size_to_factor=0, global_norm_clip_threshold=0.0)
    opt = off.create({"x": jnp.ones((2, 2))}).apply_gradient({"x": jnp.full((2, 2), 3.0)})
    np.testing.assert_allclose(opt.state.param_states["x"].v_row, [9.0, 9.0], rtol=1e-6)


def test_apply_param_gradient_is_one_parameter_of_apply_gradient():
    opt_def = Adafactor(learning_rate=0.1, beta1=0.9, min_dim_size_to_factor=2)
    x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    g = jnp.cos(x)
    state = opt_def.init_param_state(x, "w")
    p1, s1 = opt_def.apply_param_gradient(jnp.asarray(0), opt_def.hyper_params, x, state, g, "w")
    p2, s2 = opt_def.apply_gradient(opt_def.hyper_params, {"w": x}, opt_def.init_state({"w": x}), {"w": g})
    np.testing.assert_allclose(p1, p2["w"], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2.param_states["w"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_subclass_per_parameter_rule_is_used():
    class Frozen(Adafactor):
        def apply_param_gradient(self, step, hyper_params, param, state, grad, path):
            return param, state

    opt_def = Frozen(learning_rate=0.1)
    opt = opt_def.create({"w": jnp.ones(3)}).apply_gradient({"w": jnp.ones(3)})
    np.testing.assert_array_equal(opt.target["w"], jnp.ones(3))
    assert int(opt.state.step) == 1


# -- agreement with optax's adafactor --------------------------------------------------------


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
        np.testing.assert_array_equal(a, e)


def test_other_options_change_the_step_as_documented():
    params, grads_fn = params_and_grads()

    def one_step(**options):
        return run_legacy(
            Adafactor(learning_rate=0.05, min_dim_size_to_factor=2, **options), params, grads_fn, steps=1
        )

    base = one_step()
    capped = one_step(max_parameter_scale=0.1)
    # The parameter scale of dense/kernel is its RMS (~0.62); capped at 0.1 the step shrinks.
    step = np.abs(np.asarray(params["dense"]["kernel"] - base.target["dense"]["kernel"]))
    capped_step = np.abs(np.asarray(params["dense"]["kernel"] - capped.target["dense"]["kernel"]))
    rms = float(jnp.sqrt(jnp.mean(params["dense"]["kernel"] ** 2)))
    np.testing.assert_allclose(capped_step, step * 0.1 / rms, rtol=1e-5)

    # weight_decay_rate_lr_exponent=1 with no weight_decay_rate: a decay of 1 * lr ** 1.
    exponent = one_step(weight_decay_rate_lr_exponent=1.0)
    decayed = one_step(weight_decay_rate=0.05)
    assert_trees_close(exponent.target, decayed.target, rtol=1e-6)
    # With weight_decay_rate=0.5 as well: 0.5 * 0.05.
    both = one_step(weight_decay_rate=0.5, weight_decay_rate_lr_exponent=1.0)
    quarter = one_step(weight_decay_rate=0.025)
    assert_trees_close(both.target, quarter.target, rtol=1e-6)


def test_momentum_dtype():
    opt_def = Adafactor(0.1, beta1=0.9, dtype_momentum=jnp.bfloat16, min_dim_size_to_factor=8)
    opt = opt_def.create({"w": jnp.ones((24, 16))})
    state = opt.state.param_states["w"]
    assert state.m.shape == (24, 16) and state.m.dtype == jnp.bfloat16 and state.v_row.dtype == jnp.float32
    state = opt.apply_gradient({"w": jnp.ones((24, 16))}).state.param_states["w"]
    assert state.m.dtype == jnp.bfloat16


def test_skip_nan_updates_keeps_param_and_state():
    opt_def = Adafactor(learning_rate=0.1, min_dim_size_to_factor=2, skip_nan_updates=True)
    opt = opt_def.create({"w": jnp.ones((4, 4)), "b": jnp.ones(4)})
    new = opt.apply_gradient({"w": jnp.full((4, 4), jnp.nan), "b": jnp.ones(4)})
    np.testing.assert_array_equal(new.target["w"], opt.target["w"])
    np.testing.assert_array_equal(new.state.param_states["w"].v_row, opt.state.param_states["w"].v_row)
    assert not np.allclose(new.target["b"], opt.target["b"])


# -- one compiled program per step -------------------------------------------------------------


def test_a_new_learning_rate_does_not_recompile(monkeypatch):
    traced = []
    original = adafactor_step.param_update

    def counting(*args, **kwargs):
        traced.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(adafactor_step, "param_update", counting)
    params = {"a": jnp.ones((7, 13)), "b": jnp.ones(13)}  # shapes no other test uses: a fresh trace
    opt = Adafactor(0.1, min_dim_size_to_factor=2).create(params)
    grads = jax.tree.map(jnp.ones_like, params)
    opt = opt.apply_gradient(grads)
    assert len(traced) == 2  # one trace, two parameters
    for lr in (0.01, 0.2, 3.0):
        opt = opt.apply_gradient(grads, learning_rate=lr)
    opt = opt.apply_gradient(grads, learning_rate=jnp.float32(0.5))  # an array: traced once more
    opt = opt.apply_gradient(grads, learning_rate=jnp.float32(0.7))
    assert len(traced) == 4
    # Under jit the learning rate may be a tracer too.
    step = jax.jit(lambda o, lr: o.apply_gradient(grads, learning_rate=lr))
    first = step(opt, 0.1)
    traced_so_far = len(traced)
    second = step(opt, 0.2)
    assert len(traced) == traced_so_far
    assert int(first.state.step) == int(opt.state.step) + 1
    assert not np.allclose(first.target["a"], second.target["a"])


def test_the_compiled_step_matches_one_traced_by_hand():
    # apply_gradient inside the user's jit and eagerly (its own compiled program) agree.
    params, grads_fn = params_and_grads()
    opt_def = Adafactor(learning_rate=0.05, min_dim_size_to_factor=2, beta1=0.9, clipping_threshold=0.5)
    eager = opt_def.create(params)
    jitted = opt_def.create(params)
    step = jax.jit(lambda o, i: o.apply_gradient(grads_fn(o.target, i)))
    for i in range(3):
        eager = eager.apply_gradient(grads_fn(eager.target, i))
        jitted = step(jitted, i)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# -- checkpoints -----------------------------------------------------------------------------


def t5x_state_dict(step, kernel, kernel_state, scale, scale_state):
    """A state dict as T5X's legacy Adafactor writes it, built by hand."""
    return {
        "target": {"dense": {"kernel": kernel}, "norm": {"scale": scale}},
        "state": {
            "step": np.asarray(step, np.int32),
            "param_states": {
                "dense": {"kernel": dict(zip(("v_row", "v_col", "v", "m"), kernel_state, strict=True))},
                "norm": {"scale": dict(zip(("v_row", "v_col", "v", "m"), scale_state, strict=True))},
            },
        },
    }


def test_a_t5x_state_dict_restores_and_continues():
    rng = np.random.default_rng(0)
    f32 = lambda *shape: rng.uniform(0.5, 1.5, shape).astype(np.float32)  # noqa: E731
    kernel, scale = f32(6, 5), f32(5)
    # (6, 5), factored: v_row averages over axis 0 (the largest) and keeps (5,), v_col keeps (6,).
    kernel_state = (f32(5), f32(6), np.zeros(1, np.float32), f32(6, 5))
    scale_state = (np.zeros(1, np.float32), np.zeros(1, np.float32), f32(5), f32(5))
    sd = t5x_state_dict(7, kernel, kernel_state, scale, scale_state)
    opt_def = Adafactor(learning_rate=0.05, beta1=0.9, min_dim_size_to_factor=4)
    params = {"dense": {"kernel": jnp.zeros((6, 5))}, "norm": {"scale": jnp.zeros(5)}}
    restored = opt_def.create(params).restore_state(sd)
    assert int(restored.state.step) == 7
    np.testing.assert_array_equal(restored.state.param_states["dense"]["kernel"].v_col, kernel_state[1])
    assert restored.state.param_states["dense"]["kernel"].v_row.shape == (5,)
    # Written back in the same layout, value for value.
    back = jax.tree.map(np.asarray, restored.state_dict())
    assert jax.tree.structure(back) == jax.tree.structure(sd)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(sd), strict=True):
        np.testing.assert_array_equal(a, b)

    # One step from there, by the paper's formulas in float64.
    g = rng.normal(0.0, 1.0, (6, 5))
    gs = rng.normal(0.0, 1.0, 5)
    new = restored.apply_gradient(
        {"dense": {"kernel": jnp.asarray(g, jnp.float32)}, "norm": {"scale": jnp.asarray(gs, jnp.float32)}}
    )
    decay = 1.0 - 8.0**-0.8
    g2 = g * g + 1e-30
    r = decay * kernel_state[0] + (1 - decay) * g2.mean(axis=0)
    c = decay * kernel_state[1] + (1 - decay) * g2.mean(axis=1)
    u = g / np.sqrt(np.outer(c, r) / r.mean())
    u /= max(1.0, np.sqrt(np.mean(u * u)))
    m = 0.9 * kernel_state[3] + 0.1 * (0.05 * max(np.sqrt(np.mean(kernel**2)), 1e-3) * u)
    got = new.state.param_states["dense"]["kernel"]
    np.testing.assert_allclose(got.v_row, r, rtol=1e-5)
    np.testing.assert_allclose(got.v_col, c, rtol=1e-5)
    np.testing.assert_allclose(got.m, m, rtol=1e-5)
    np.testing.assert_allclose(new.target["dense"]["kernel"], kernel - m, rtol=1e-5)
    v = decay * scale_state[2] + (1 - decay) * (gs * gs + 1e-30)
    np.testing.assert_allclose(new.state.param_states["norm"]["scale"].v, v, rtol=1e-5)
    assert int(new.state.step) == 8


def test_a_checkpoint_resumes_step_for_step():
    params, grads_fn = params_and_grads()
    opt_def = Adafactor(learning_rate=0.05, min_dim_size_to_factor=2, beta1=0.9)
    straight = run_legacy(opt_def, params, grads_fn, steps=4)
    first = run_legacy(opt_def, params, grads_fn, steps=2)
    sd = jax.tree.map(np.asarray, first.state_dict())
    assert set(sd["state"]["param_states"]["dense"]["kernel"]) == {"v_row", "v_col", "v", "m"}
    resumed = opt_def.create(params).restore_state(sd)
    for i in range(2, 4):
        resumed = resumed.apply_gradient(grads_fn(resumed.target, i))
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(a, b)
    bad = jax.tree.map(np.asarray, sd)
    bad["state"]["param_states"]["dense"]["kernel"]["v_row"] = np.zeros(6)  # it is (4,)
    with pytest.raises(ValueError, match="v_row"):
        first.restore_state(bad)


# -- with MultiOptimizer -------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_multi_optimizer_of_two_adafactors_equals_one_with_an_hparam_map():
    params, grads_fn = params_and_grads()
    kernels = traverse_util.ModelParamTraversal(lambda path, _: "kernel" in path)
    biases = traverse_util.ModelParamTraversal(lambda path, _: "bias" in path)
    multi = MultiOptimizer(
        (
            (kernels, Adafactor(learning_rate=0.05, min_dim_size_to_factor=2)),
            (
                biases,
                Adafactor(learning_rate=0.05, min_dim_size_to_factor=2, multiply_by_parameter_scale=False),
            ),
        )
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


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_multi_optimizer_passes_the_axes_of_its_subset():
    params = {"dense": {"kernel": jnp.ones((2, 3, 4)), "bias": jnp.ones(4)}}
    axes = {"dense": {"kernel": P("layers", "embed", "mlp"), "bias": P("mlp")}}
    kernels = traverse_util.ModelParamTraversal(lambda path, _: "kernel" in path)
    sub = Adafactor(0.1, logical_factor_rules=adafactor.standard_logical_factor_rules())
    multi = MultiOptimizer(((kernels, sub),))
    multi.set_param_axes(axes)
    assert sub.hyper_params.factor_map == {"dense/kernel": (FactorDim.BATCH, FactorDim.ROW, FactorDim.COLUMN)}
    opt = multi.create(params)
    assert opt.state.param_states["dense"]["bias"] is None
    assert opt.state.param_states["dense"]["kernel"].v_row.shape == (2, 3)
    derived = multi.derive_logical_axes(opt, axes).state.param_states
    assert derived["dense"]["bias"] is None
    assert derived["dense"]["kernel"].v_col == P("layers", "mlp")
