"""float32 master weights for narrower params: ``treeopt.Optimizer(tx, master_dtype=jnp.float32)``.

The reference is raw optax on ``params.astype(float32)``, with the gradients
cast up inside the same jitted step: the masters must equal it bit for bit,
and the params returned must be the masters cast down. A control shows the
failure the option fixes: bfloat16 params at a fine-tuning learning rate do
not move at all without it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import treeopt
from treeopt.errors import StateDictError

from _helpers import assert_trees_equal, device_mesh

STEPS = 100
F32, BF16 = jnp.float32, jnp.bfloat16


def _weights(key, shape):
    """Magnitudes in [0.5, 1.5), random signs: bfloat16 spaces such values 2**-8 to 2**-7 apart."""
    k1, k2 = jax.random.split(key)
    sign = jnp.where(jax.random.bernoulli(k1, shape=shape), 1.0, -1.0)
    return (sign * jax.random.uniform(k2, shape, minval=0.5, maxval=1.5)).astype(BF16)


def bf16_params():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return {
        "dense": {"kernel": _weights(k1, (8, 16)), "bias": _weights(k2, (16,))},
        "head": _weights(k3, (16, 4)),
    }


def grads_at(i, like):
    """A fixed gradient sequence, in float32 (the dtype the reference trains in)."""
    keys = jax.random.split(jax.random.key(100 + i), len(jax.tree.leaves(like)))
    leaves = [jax.random.normal(k, x.shape, F32) for k, x in zip(keys, jax.tree.leaves(like), strict=True)]
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def as_f32(tree):
    return jax.tree.map(lambda x: x.astype(F32), tree)


def reference(tx, params, steps=STEPS):
    """Raw optax on the float32 copies; the gradients are cast up inside the jitted step too."""

    @jax.jit
    def step(params32, state, grads):
        updates, state = tx.update(as_f32(grads), state, params32)
        return optax.apply_updates(params32, updates), state

    params32 = as_f32(params)
    state = tx.init(params32)
    for i in range(steps):
        params32, state = step(params32, state, jax.tree.map(lambda g: g.astype(BF16), grads_at(i, params)))
    return params32, state


def treeopt_run(tx, params, steps=STEPS, **kwargs):
    @jax.jit
    def step(params, opt, grads):
        return opt.update(grads, params), opt

    opt = treeopt.Optimizer(tx, **kwargs).init(params)
    for i in range(steps):
        params, opt = step(params, opt, jax.tree.map(lambda g: g.astype(BF16), grads_at(i, params)))
    return params, opt


def named(tree):
    return dict(zip(treeopt.leaf_names(tree), jax.tree.leaves(tree), strict=True))


TXS = {
    "adamw": lambda: optax.adamw(6e-6, weight_decay=0.01),
    "sgd": lambda: optax.sgd(6e-6, momentum=0.9),
}


@pytest.mark.parametrize("name", sorted(TXS))
def test_masters_follow_raw_optax_on_float32_copies_bit_for_bit(name):
    params = bf16_params()
    expected, expected_state = reference(TXS[name](), params)
    new_params, opt = treeopt_run(TXS[name](), params, master_dtype=F32)
    assert {k: v.dtype for k, v in opt.master.items()} == dict.fromkeys(named(params), jnp.dtype(F32))
    assert_trees_equal(opt.master, named(expected))
    assert_trees_equal(opt.opt_state, _flat_state(expected_state, params))
    # The params returned are the masters cast down, in the params' own structure and dtypes.
    assert_trees_equal(new_params, jax.tree.map(lambda m, p: m.astype(p.dtype), expected, params))


def test_adafactor_masters_stay_within_one_ulp_of_float32_optax():
    # Factored second moments (the 8 x 16 kernel) and the parameter scale reduce over the masters:
    # the follow-the-param check must not change how XLA orders those reductions.
    def tx():
        return optax.adafactor(1e-2, min_dim_size_to_factor=8)

    params = bf16_params()
    expected, _ = reference(tx(), params, steps=50)
    new_params, opt = treeopt_run(tx(), params, steps=50, master_dtype=F32)
    for name, value in named(expected).items():
        np.testing.assert_array_max_ulp(np.asarray(opt.master[name]), np.asarray(value), maxulp=1)
    assert_trees_equal(named(new_params), {name: m.astype(BF16) for name, m in opt.master.items()})


def _flat_state(state, params):
    """The reference's optax state over nested params, as treeopt keys it: by name."""
    names = treeopt.leaf_names(params)

    def flat(node):
        if isinstance(node, dict) and jax.tree.structure(node) == jax.tree.structure(params):
            return dict(zip(names, jax.tree.leaves(node), strict=True))
        return node

    return jax.tree.map(flat, state, is_leaf=lambda x: isinstance(x, dict))


def _moved(after, before):
    """The fraction of elements that changed."""
    changed = [jnp.mean(a.astype(F32) != b.astype(F32)) for a, b in zip(after, before, strict=True)]
    return float(jnp.mean(jnp.stack(changed)))


@pytest.mark.parametrize("name", sorted(TXS))
def test_without_masters_bfloat16_params_stall_while_float32_ones_move(name):
    params = bf16_params()
    stalled, _ = treeopt_run(TXS[name](), params)
    assert_trees_equal(stalled, params)  # every update rounded away: the loss would plateau
    moved, _ = reference(TXS[name](), params)
    assert _moved(jax.tree.leaves(moved), jax.tree.leaves(params)) == 1.0
    _, opt = treeopt_run(TXS[name](), params, master_dtype=F32)
    assert _moved(list(opt.master.values()), list(named(params).values())) == 1.0


def test_apply_updates_false_gives_updates_that_reproduce_the_default_path():
    params = bf16_params()
    tx = optax.adamw(1e-3, weight_decay=0.01)
    by_params = treeopt.Optimizer(tx, master_dtype=F32).init(params)
    by_updates = treeopt.Optimizer(tx, master_dtype=F32).init(params)
    p1, p2 = params, params
    for i in range(5):
        grads = jax.tree.map(lambda g: g.astype(BF16), grads_at(i, params))
        p1 = by_params.update(grads, p1)
        updates = by_updates.update(grads, p2, apply_updates=False)
        assert all(u.dtype == F32 for u in jax.tree.leaves(updates))
        p2 = optax.apply_updates(p2, updates)
        assert_trees_equal(p2, p1)
    assert_trees_equal(by_updates.master, by_params.master)
    # Without params, the updates are relative to the params the optimizer returned last.
    grads = jax.tree.map(lambda g: g.astype(BF16), grads_at(9, params))
    expected = by_params.update(grads, p1)
    assert_trees_equal(optax.apply_updates(p2, by_updates.update(grads, apply_updates=False)), expected)


def test_leaves_already_of_the_master_dtype_are_stepped_as_without_the_option():
    params = {"narrow": bf16_params()["head"], "wide": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)}
    tx = optax.adam(1e-2)
    with_option = treeopt.Optimizer(tx, master_dtype=F32).init(params)
    without = treeopt.Optimizer(tx).init(params)
    assert list(with_option.master) == ["narrow"]
    p1, p2 = params, params
    for i in range(3):
        grads = {"narrow": grads_at(i, params)["narrow"].astype(BF16), "wide": grads_at(i, params)["wide"]}
        p1, p2 = with_option.update(grads, p1), without.update(grads, p2)
    assert_trees_equal(p1["wide"], p2["wide"])
    assert_trees_equal(with_option.opt_state[0].mu["wide"], without.opt_state[0].mu["wide"])
    assert without.master == {} and with_option.master["narrow"].dtype == F32


@pytest.mark.parametrize("bad", [jnp.int32, "int8", jnp.bool_, jnp.complex64, object()])
def test_a_master_dtype_that_is_not_floating_is_refused_at_construction(bad):
    with pytest.raises(TypeError, match="master_dtype must be a floating-point dtype"):
        treeopt.Optimizer(optax.sgd(0.1), master_dtype=bad)


def test_a_64_bit_master_dtype_needs_64_bit_jax():
    with pytest.raises(ValueError, match="jax_enable_x64"):
        treeopt.Optimizer(optax.sgd(0.1), master_dtype=jnp.float64)


# -- the masters are leaves: jit, donation, vmap, eager -----------------------------------------------


def test_the_jitted_step_traces_once_and_takes_donated_buffers():
    params = bf16_params()
    traces = []

    @jax.jit
    def step(params, opt, grads):
        traces.append(None)
        return opt.update(grads, params), opt

    donated = jax.jit(step.__wrapped__, donate_argnums=(0, 1))
    tx = optax.adam(1e-3)
    opt_a = treeopt.Optimizer(tx, master_dtype=F32).init(params)
    opt_b = treeopt.Optimizer(tx, master_dtype=F32).init(params)
    pa, pb = params, params
    for i in range(4):
        grads = jax.tree.map(lambda g: g.astype(BF16), grads_at(i, params))
        pa, opt_a = step(pa, opt_a, grads)
        pb, opt_b = donated(pb, opt_b, grads)
    assert len(traces) == 1  # donation changes the compiled program, not the trace: none after the first
    assert_trees_equal(opt_b.master, opt_a.master)
    assert_trees_equal(pb, pa)


def test_eager_update_equals_the_jitted_one():
    params = bf16_params()
    tx = optax.adamw(1e-3)
    eager = treeopt.Optimizer(tx, master_dtype=F32).init(params)
    p_eager = params
    for i in range(3):
        p_eager = eager.update(jax.tree.map(lambda g: g.astype(BF16), grads_at(i, params)), p_eager)
    p_jit, jitted = treeopt_run(tx, params, steps=3, master_dtype=F32)
    assert_trees_equal(eager.master, jitted.master)
    assert_trees_equal(p_eager, p_jit)


def test_a_batch_of_optimizers_with_masters_under_vmap():
    stacked = jax.tree.map(lambda x: jnp.stack([x, -x]), bf16_params())
    tx = optax.sgd(0.5)
    opts = jax.vmap(treeopt.Optimizer(tx, master_dtype=F32).init)(stacked)
    grads = jax.tree.map(jnp.ones_like, stacked)
    new, opts = jax.vmap(lambda p, o, g: (o.update(g, p), o))(stacked, opts, grads)
    assert opts.master["head"].shape == (2, 16, 4)
    np.testing.assert_array_equal(opts.master["head"], stacked["head"].astype(F32) - 0.5)
    assert_trees_equal(new["head"], opts.master["head"].astype(BF16))


# -- state dicts and checkpoints ------------------------------------------------------------------------


def trained(steps=3, **kwargs):
    params = bf16_params()
    return treeopt_run(optax.adam(1e-3), params, steps=steps, **kwargs)


def test_the_state_dict_holds_the_masters_by_name_and_round_trips_bit_for_bit():
    _, opt = trained(master_dtype=F32)
    sd = opt.state_dict()
    assert sorted(sd["master"]) == ["dense/bias", "dense/kernel", "head"]
    fresh = treeopt.Optimizer(optax.adam(1e-3), master_dtype=F32).init(bf16_params())
    restored = fresh.load_state_dict(sd)
    assert_trees_equal(restored.master, opt.master)
    assert_trees_equal(restored.state_dict(), sd)
    through_bytes = treeopt.serialization.from_bytes(fresh, treeopt.serialization.to_bytes(opt))
    assert_trees_equal(through_bytes.state_dict(), sd)
    assert "master" not in treeopt.Optimizer(optax.adam(1e-3)).init(bf16_params()).state_dict()


def test_masters_loaded_into_an_optimizer_without_them_or_the_reverse_are_a_mismatch():
    _, with_masters = trained(master_dtype=F32)
    _, without = trained()
    with pytest.raises(StateDictError) as err:
        treeopt.Optimizer(optax.adam(1e-3)).init(bf16_params()).load_state_dict(with_masters.state_dict())
    assert err.value.report.unexpected == ("master/dense/bias", "master/dense/kernel", "master/head")
    fresh = treeopt.Optimizer(optax.adam(1e-3), master_dtype=F32).init(bf16_params())
    with pytest.raises(StateDictError) as err:
        fresh.load_state_dict(without.state_dict())
    assert "master/head" in err.value.report.missing
    assert "master/<parameter name>" in str(err.value)


def test_orbax_checkpoints_and_the_manager_round_trip_the_masters(tmp_path):
    params, opt = trained(master_dtype=F32)
    target = jax.eval_shape(treeopt.Optimizer(optax.adam(1e-3), master_dtype=F32).init, bf16_params())
    treeopt.checkpoint.save(tmp_path / "one", opt, params)
    restored, restored_params = treeopt.checkpoint.restore(
        tmp_path / "one", target, params=jax.eval_shape(lambda: params)
    )
    assert_trees_equal(restored.state_dict(), opt.state_dict())
    assert_trees_equal(restored_params, params)
    with treeopt.checkpoint.CheckpointManager(tmp_path / "steps") as manager:
        manager.save(int(opt.step), opt, params)
        manager.wait_until_finished()
        from_manager = manager.restore(target)
    assert_trees_equal(from_manager.master, opt.master)
    # Training goes on identically from the restored optimizer.
    grads = jax.tree.map(lambda g: g.astype(BF16), grads_at(7, params))
    assert_trees_equal(from_manager.update(grads, params), opt.update(grads, params))


def test_warm_start_keeps_the_masters_init_made_and_casts_a_bfloat16_runs_moments_up():
    params = bf16_params()
    bf16_run = treeopt.Optimizer(optax.adam(1e-3)).init(params)  # no masters: bfloat16 moments
    for i in range(2):
        params = bf16_run.update(jax.tree.map(lambda g: g.astype(BF16), grads_at(i, params)), params)
    assert bf16_run.opt_state[0].mu["head"].dtype == BF16
    target = treeopt.Optimizer(optax.adam(1e-3), master_dtype=F32).init(params)
    warm, report = treeopt.serialization.warm_start(target, bf16_run)
    assert_trees_equal(warm.master, target.master)  # from the params: the source has none
    assert sorted(report.missing) == ["master/dense/bias", "master/dense/kernel", "master/head"]
    assert ("opt_state/0/mu/head", "bfloat16", "float32") in report.cast
    assert len(report.cast) == 6 and "cast up" in str(report)
    np.testing.assert_array_equal(warm.opt_state[0].mu["head"], bf16_run.opt_state[0].mu["head"].astype(F32))
    assert warm.opt_state[0].mu["head"].dtype == F32


# -- sharding: each master gets its param's spec, and ZeRO-1 splits it over the data axis ---------


def test_each_master_gets_its_params_spec_and_zero_adds_the_data_axis():
    params = bf16_params()
    opt = treeopt.Optimizer(optax.adam(1e-3), master_dtype=F32).init(params)
    specs = {"dense": {"kernel": P(None, "model"), "bias": P("model")}, "head": P("model", None)}
    plain = opt.partition_specs(specs)
    assert plain.master == {
        "dense/kernel": P(None, "model"),
        "dense/bias": P("model"),
        "head": P("model", None),
    }
    mesh = device_mesh((4, 2), ("data", "model"))
    zero = opt.partition_specs(specs, shard_state_over="data", mesh=mesh)
    assert zero.master["dense/kernel"] == P("data", "model")
    assert zero.master["head"] == P("model", "data")  # its free dimension, 4, divides over data=4
    report = treeopt.partitioning.zero_report(opt, specs, mesh, "data")
    assert "master['dense/kernel']" in [leaf.path for leaf in report.sharded]


ZERO_SHAPES = {"embed": (64, 16), "dense": {"kernel": (16, 32), "bias": (32,)}, "head": (32, 8)}


def zero_params():
    keys = iter(jax.random.split(jax.random.key(1), 4))
    return jax.tree.map(
        lambda shape: _weights(next(keys), shape), ZERO_SHAPES, is_leaf=lambda x: isinstance(x, tuple)
    )


def zero_loss(params, x):
    h = jnp.tanh(x @ params["embed"].astype(F32))
    h = jnp.tanh(h @ params["dense"]["kernel"].astype(F32) + params["dense"]["bias"].astype(F32))
    return jnp.mean((h @ params["head"].astype(F32)) ** 2)


def test_zero_one_splits_masters_and_state_eightfold_with_the_same_numbers():
    mesh = device_mesh((8,), ("data",))
    params = zero_params()
    specs = jax.tree.map(lambda _: P(), params)
    tx = optax.adamw(1e-3, weight_decay=0.01)
    opt = treeopt.partitioning.init_sharded(
        treeopt.Optimizer(tx, master_dtype=F32), params, mesh, specs, shard_state_over="data"
    )
    shardings = treeopt.partitioning.optimizer_shardings(opt, specs, mesh, shard_state_over="data")
    device = jax.devices()[0]

    def on_device0(tree):
        return sum(
            s.data.nbytes
            for leaf in jax.tree.leaves(tree)
            for s in leaf.addressable_shards
            if s.device == device
        )

    per_param = [opt.master, opt.opt_state[0].mu, opt.opt_state[0].nu]
    assert on_device0(per_param) * 8 == sum(x.nbytes for x in jax.tree.leaves(per_param))
    assert all(leaf.sharding.spec != P() for leaf in opt.master.values())

    replicated = NamedSharding(mesh, P())

    def step(params, opt, x):
        grads = jax.grad(zero_loss)(params, x)
        return opt.update(grads, params), opt

    def data_parallel_step(params, opt, x):
        # Gradients whole on every device, as after the data-parallel all-reduce: XLA would
        # otherwise split the backward pass like the state and sum in another order.
        grads = jax.lax.with_sharding_constraint(jax.grad(zero_loss)(params, x), replicated)
        return opt.update(grads, params), opt

    # Params and batch replicated, so every device computes the same gradients; only the
    # optimizer's step is split (ZeRO-1), and it is elementwise.
    sharded = jax.jit(
        data_parallel_step,
        in_shardings=(replicated, shardings, replicated),
        out_shardings=(replicated, shardings),
        donate_argnums=(1,),
    )
    unsharded = jax.jit(step)
    plain = treeopt.Optimizer(tx, master_dtype=F32).init(params)
    p_sharded, p_plain = params, params
    for i in range(20):
        x = jax.random.normal(jax.random.key(50 + i), (16, 64))
        p_sharded, opt = sharded(p_sharded, opt, x)
        p_plain, plain = unsharded(p_plain, plain, x)
    for name in plain.master:
        np.testing.assert_allclose(opt.master[name], plain.master[name], rtol=1e-6, atol=1e-7)
    assert on_device0(opt.master) * 8 == sum(x.nbytes for x in opt.master.values())


# -- models and combinators ------------------------------------------------------------------------------


def test_an_nnx_module_in_bfloat16_is_updated_in_place_from_its_masters():
    from flax import nnx

    model = nnx.Linear(8, 4, param_dtype=BF16, rngs=nnx.Rngs(0))
    kernel = model.kernel[...]
    opt = treeopt.Optimizer(optax.sgd(1e-4), master_dtype=F32).init(model)
    assert sorted(opt.master) == ["bias", "kernel"]
    x = jnp.ones((2, 8))
    for _ in range(3):
        grads = nnx.grad(lambda m: m(x).astype(F32).sum())(model)
        assert opt.update(grads, model) is model
    np.testing.assert_array_equal(model.kernel[...], opt.master["kernel"].astype(BF16))
    assert model.kernel[...].dtype == BF16
    np.testing.assert_allclose(opt.master["kernel"], kernel.astype(F32) - 3e-4 * 2, rtol=1e-6)


def test_an_equinox_module_in_bfloat16_trains_from_its_masters():
    import equinox as eqx

    model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
    model = jax.tree.map(lambda x: x.astype(BF16) if eqx.is_inexact_array(x) else x, model)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt = treeopt.Optimizer(optax.adam(1e-5), master_dtype=F32).init(params)

    @jax.jit
    def step(params, opt, x):
        grads = jax.grad(lambda p: eqx.combine(p, static)(x).astype(F32).sum())(params)
        return opt.update(grads, params), opt

    for i in range(3):
        params, opt = step(params, opt, jnp.full(4, float(i)))
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(BF16)}
    assert sorted(named(params)) == sorted(opt.master)
    for name, leaf in named(params).items():
        np.testing.assert_array_equal(leaf, opt.master[name].astype(BF16))


def _steps(tx, params, steps=4, **kwargs):
    opt = treeopt.Optimizer(tx, **kwargs).init(params)
    for i in range(steps):
        params = opt.update(jax.tree.map(lambda g: g.astype(BF16), grads_at(i, params)), params)
    return params, opt


def _reference_flat(tx, params, steps=4):
    """Raw optax on the float32 copies of the flat named params."""
    flat = as_f32(named(params))
    state = tx.init(flat)
    for i in range(steps):
        grads = as_f32(named(jax.tree.map(lambda g: g.astype(BF16), grads_at(i, params))))
        updates, state = tx.update(grads, state, flat)
        flat = optax.apply_updates(flat, updates)
    return flat


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: optax.masked(optax.adam(1e-2), treeopt.mask("*kernel")),
        lambda: optax.multi_transform(
            {"adam": optax.adam(1e-2), "frozen": optax.set_to_zero()},
            treeopt.labels({"head": "frozen"}, default="adam"),
        ),
        lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    ],
    ids=["masked", "multi_transform", "MultiSteps"],
)
def test_masks_labels_by_name_and_multi_steps_run_on_the_masters(make_tx):
    params = bf16_params()
    new, opt = _steps(make_tx(), params, master_dtype=F32)
    tx = make_tx()
    expected = _reference_flat(
        tx.gradient_transformation() if isinstance(tx, optax.MultiSteps) else tx, params
    )
    for name, master in opt.master.items():
        np.testing.assert_allclose(master, expected[name], rtol=1e-6, atol=0)
        np.testing.assert_array_equal(named(new)[name], master.astype(BF16))


def test_the_nnx_drop_in_passes_master_dtype_and_trains_like_the_core():
    from flax import nnx

    import treeopt.nnx

    def model():
        return nnx.Linear(8, 4, param_dtype=BF16, rngs=nnx.Rngs(0))

    def loss(m):
        return (m(jnp.ones((2, 8))).astype(F32) ** 2).sum()

    with_drop_in, with_core = model(), model()
    drop_in = treeopt.nnx.Optimizer(with_drop_in, optax.adam(1e-3), wrt=nnx.Param, master_dtype=F32)
    core = treeopt.Optimizer(optax.adam(1e-3), master_dtype=F32).init(with_core)
    for _ in range(4):
        drop_in.update(with_drop_in, nnx.grad(loss)(with_drop_in))
        core.update(nnx.grad(loss)(with_core), with_core)
    assert_trees_equal(drop_in.state_dict()["master"], core.state_dict()["master"])
    assert_trees_equal(nnx.state(with_drop_in, nnx.Param), nnx.state(with_core, nnx.Param))
    assert with_drop_in.kernel[...].dtype == BF16
