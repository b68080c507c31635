"""The state's dtypes are fixed at init: mixed precision neither retraces nor breaks reloading."""

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import treeopt


def mixed_params():
    return {
        "half": jnp.linspace(-1.0, 1.0, 8, dtype=jnp.bfloat16).reshape(2, 4),
        "full": jnp.linspace(0.5, 1.5, 3, dtype=jnp.float32),
    }


def grads_of(params, step):
    return jax.tree.map(lambda p: (jnp.cos(p.astype(jnp.float32) * (step + 1))).astype(p.dtype), params)


TX = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=1e-3)


def state_dtypes(opt):
    return {path: leaf.dtype for path, leaf in jax.tree_util.tree_leaves_with_path(opt.opt_state)}


def test_init_gives_the_dtypes_the_update_returns():
    opt = treeopt.Optimizer(TX).init(mixed_params())
    before = state_dtypes(opt)
    opt.update(grads_of(mixed_params(), 0), mixed_params())
    assert state_dtypes(opt) == before
    # Raw optax keeps mu of the bfloat16 param in bfloat16 at init, float32 after a step.
    assert opt.opt_state.inner_state[0].mu["half"].dtype == jnp.float32


def test_jitted_mixed_precision_step_traces_once_and_matches_raw_optax_bit_for_bit():
    traces = []

    @jax.jit
    def step(opt, params, grads):
        traces.append(1)
        return opt.update(grads, params), opt

    params = mixed_params()
    opt = treeopt.Optimizer(TX).init(params)
    ref_params, ref_state = mixed_params(), TX.init(mixed_params())
    ref_update = jax.jit(TX.update)
    for i in range(3):
        params, opt = step(opt, params, grads_of(params, i))
        updates, ref_state = ref_update(grads_of(ref_params, i), ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        for name in params:
            assert params[name].dtype == ref_params[name].dtype
            got, want = np.asarray(params[name], np.float32), np.asarray(ref_params[name], np.float32)
            np.testing.assert_array_equal(got, want)
    assert len(traces) == 1


@pytest.mark.parametrize("route", ["load_state_dict", "flax bytes", "orbax"])
def test_state_dict_after_steps_loads_into_init_and_eval_shape_of_init(route, tmp_path):
    params = mixed_params()
    opt = treeopt.Optimizer(TX).init(params)
    for i in range(2):
        params = opt.update(grads_of(params, i), params)
    concrete = treeopt.Optimizer(TX).init(mixed_params())
    abstract = jax.eval_shape(treeopt.Optimizer(TX).init, mixed_params())
    for target in (concrete, abstract):
        if route == "load_state_dict":
            loaded = target.load_state_dict(opt.state_dict())
        elif route == "flax bytes":
            if isinstance(target.step, jax.ShapeDtypeStruct):
                continue  # flax bytes restore into concrete targets
            loaded = flax.serialization.from_bytes(target, flax.serialization.to_bytes(opt))
        else:
            path = tmp_path / f"ckpt-{type(target.step).__name__}"
            treeopt.checkpoint.save(path, opt)
            loaded = treeopt.checkpoint.restore(path, target)
        got, want = loaded.state_dict(), opt.state_dict()
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)
        assert state_dtypes(loaded) == state_dtypes(opt)


def test_transformations_needing_extra_arguments_still_initialize():
    tx = optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau())
    params, grads = {"w": jnp.ones(2)}, {"w": jnp.ones(2)}
    opt = treeopt.Optimizer(tx).init(params)
    plateau = opt.opt_state[1]
    assert float(plateau.best_value) == np.inf and float(plateau.scale) == 1.0  # tx.init's, with no value
    new = opt.update(grads, params, value=jnp.float32(1.0))
    np.testing.assert_array_equal(new["w"], np.full(2, 0.9, np.float32))  # 1 - 0.1 * 1 * scale 1
    plateau = opt.opt_state[1]
    assert float(plateau.best_value) == 1.0 and int(plateau.plateau_count) == 0  # the value reached tx
    assert int(opt.step) == 1
    # The same step of raw optax: the same params and state.
    updates, raw_state = tx.update(grads, tx.init(params), params, value=jnp.float32(1.0))
    np.testing.assert_array_equal(new["w"], optax.apply_updates(params, updates)["w"])
    for got, want in zip(jax.tree.leaves(opt.opt_state), jax.tree.leaves(raw_state), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
