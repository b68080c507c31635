"""JAX's explicit sharding mode: everything that works on an auto mesh works on an explicit one.

``jax.make_mesh`` gives explicit axes by default in current JAX, and a value's
sharding is then part of its type. Each test runs on both axis types on the 8
virtual CPU devices (``data=4 x model=2``): ``init_sharded``, ZeRO-1
(``shard_state_over="data"``), master weights, and a checkpoint round trip.
``update`` must return each param with the sharding it came in with (under
explicit axes the step would otherwise hand the model ZeRO's data axis, and the
model's next matmul fails with ``ShardingTypeError``); the state keeps its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import treeopt
from treeopt.partitioning import init_sharded, named_shardings, optimizer_shardings

from _helpers import device_mesh

AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}
SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}
STEPS = 3


def make_params(mesh, dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": 0.3 * jax.random.normal(k1, (16, 8)),
        "b1": jnp.zeros((8,)),
        "w2": 0.3 * jax.random.normal(k2, (8, 4)),
    }
    params = jax.tree.map(lambda x: x.astype(dtype), params)
    return jax.device_put(params, named_shardings(SPECS, mesh))


def batch(mesh, i):
    rng = np.random.default_rng(i)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    y = rng.standard_normal((8, 4)).astype(np.float32)
    return jax.device_put((x, y), NamedSharding(mesh, P("data", None)))


def loss_fn(params, x, y):
    # The user's model: x (data-sharded) times w1. Were w1 to come back with the
    # data axis on its contracted dimension, explicit axes refuse this matmul.
    h = jnp.tanh(x.astype(params["w1"].dtype) @ params["w1"] + params["b1"])
    out = jnp.sum(
        h[:, :, None] * params["w2"][None], axis=1
    )  # a reduction, not a matmul: no out_sharding needed
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)


@jax.jit
def train_step(params, opt, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    return opt.update(grads, params), opt


def run(axis_type, master_dtype=None, param_dtype=jnp.float32):
    mesh = device_mesh((4, 2), ("data", "model"), axis_type)
    params = make_params(mesh, param_dtype)
    opt = treeopt.Optimizer(optax.adam(1e-2), master_dtype=master_dtype)
    opt = init_sharded(opt, params, mesh, SPECS, shard_state_over="data")
    state_sh = optimizer_shardings(opt, SPECS, mesh, shard_state_over="data")
    with jax.set_mesh(mesh):
        for i in range(STEPS):
            params, opt = train_step(params, opt, *batch(mesh, i))
    return mesh, params, opt, state_sh


def zero_adam(axis_type):
    """A mesh of ``axis_type``, the params on it, and Adam's state ZeRO-split over "data"."""
    mesh = device_mesh((4, 2), ("data", "model"), axis_type)
    params = make_params(mesh)
    return mesh, params, init_sharded(treeopt.Optimizer(optax.adam(1e-2)), params, mesh, SPECS, shard_state_over="data")


def assert_shardings(tree, shardings):
    for leaf, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.sharding, sharding)


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
@pytest.mark.parametrize("master", [False, True], ids=["plain", "master_weights"])
def test_zero1_steps_keep_param_and_state_shardings(axis_type, master):
    kwargs = {"master_dtype": jnp.float32, "param_dtype": jnp.bfloat16} if master else {}
    mesh, params, opt, state_sh = run(AXIS_TYPES[axis_type], **kwargs)
    assert int(opt.step) == STEPS
    if AXIS_TYPES[axis_type] == AxisType.Explicit:
        assert_shardings(params, named_shardings(SPECS, mesh))  # not ZeRO's data axis
        assert jax.typeof(params["w1"]).sharding.spec == P(None, "model")
    assert_shardings(opt, state_sh)  # the state keeps ZeRO's shardings
    assert "data" in opt.opt_state[0].mu["w1"].sharding.spec
    if master:
        assert params["w1"].dtype == jnp.bfloat16 and opt.master["w1"].dtype == jnp.float32
        assert "data" in opt.master["w1"].sharding.spec


@pytest.mark.parametrize("master", [False, True], ids=["plain", "master_weights"])
def test_both_axis_types_give_the_same_numbers(master):
    kwargs = {"master_dtype": jnp.float32, "param_dtype": jnp.bfloat16} if master else {}
    tol = (
        {"rtol": 5e-2, "atol": 1e-3} if master else {"rtol": 1e-5, "atol": 1e-6}
    )  # bf16 sums in another order
    _, auto_params, auto_opt, _ = run(AxisType.Auto, **kwargs)
    _, explicit_params, explicit_opt, _ = run(AxisType.Explicit, **kwargs)
    for got, want in zip(
        jax.tree.leaves((explicit_params, explicit_opt)),
        jax.tree.leaves((auto_params, auto_opt)),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)


def test_eager_update_under_explicit_axes_keeps_param_shardings():
    mesh, params, opt = zero_adam(AxisType.Explicit)
    with jax.set_mesh(mesh):
        grads = jax.grad(loss_fn)(params, *batch(mesh, 0))
    new = opt.update(grads, params)  # eagerly, outside the mesh context
    assert_shardings(new, named_shardings(SPECS, mesh))
    with jax.set_mesh(mesh):
        jax.grad(loss_fn)(new, *batch(mesh, 1))  # the model takes them


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
def test_checkpoint_round_trip_and_resume(axis_type, tmp_path):
    mesh, params, opt, state_sh = run(AXIS_TYPES[axis_type])
    treeopt.checkpoint.save(tmp_path / "ckpt", opt)
    target = jax.eval_shape(treeopt.Optimizer(optax.adam(1e-2)).init, params)
    restored = treeopt.checkpoint.restore(tmp_path / "ckpt", target, shardings=state_sh)
    assert_shardings(restored, state_sh)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(opt), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with jax.set_mesh(mesh):
        new_params, resumed = train_step(params, restored, *batch(mesh, STEPS))
    assert int(resumed.step) == STEPS + 1
    if AXIS_TYPES[axis_type] == AxisType.Explicit:
        assert_shardings(new_params, named_shardings(SPECS, mesh))


def test_updates_come_back_in_the_grads_layout_and_apply_to_the_params():
    mesh, params, opt = zero_adam(AxisType.Explicit)
    with jax.set_mesh(mesh):
        grads = jax.grad(loss_fn)(params, *batch(mesh, 0))
        updates = jax.jit(lambda g, p, o: o.update(g, p, apply_updates=False))(grads, params, opt)
        new = jax.jit(optax.apply_updates)(params, updates)  # would meet ZeRO's layout on "w2"'s rows
    assert_shardings(updates, named_shardings(SPECS, mesh))
    assert_shardings(new, named_shardings(SPECS, mesh))


def test_a_row_split_kernel_under_zero_steps_as_unsharded():
    """(32, 6) split by rows over "model": "data" divides no free dimension and joins "model" on the rows.

    The grads (P("model")) meet the state (P(("model", "data"))) in the state's layout.
    """
    mesh = device_mesh((4, 2), ("data", "model"), "explicit")
    specs = {"w": P("model", None)}
    w = jax.random.normal(jax.random.key(3), (32, 6))
    opt = init_sharded(
        treeopt.Optimizer(optax.adam(1e-2)), jax.device_put({"w": w}, named_shardings(specs, mesh)), mesh, specs,
        shard_state_over="data",
    )  # fmt: skip
    assert opt.opt_state[0].mu["w"].sharding.is_equivalent_to(NamedSharding(mesh, P(("model", "data"))), 2)
    plain = treeopt.Optimizer(optax.adam(1e-2)).init({"w": w})
    step = jax.jit(lambda p, o, g: (o.update(g, p), o))
    sharded_params, params = jax.device_put({"w": w}, named_shardings(specs, mesh)), {"w": w}
    for i in range(3):
        grads = {"w": jnp.cos(w * (i + 1))}
        params, plain = step(params, plain, grads)
        with jax.set_mesh(mesh):
            sharded_params, opt = step(sharded_params, opt, jax.device_put(grads, named_shardings(specs, mesh)))
    np.testing.assert_allclose(np.asarray(sharded_params["w"]), np.asarray(params["w"]), rtol=1e-6, atol=1e-7)
    assert_shardings(sharded_params, named_shardings(specs, mesh))
    assert opt.opt_state[0].nu["w"].sharding.is_equivalent_to(NamedSharding(mesh, P(("model", "data"))), 2)


def test_an_eager_update_on_auto_axes_puts_the_params_back_on_their_shardings():
    mesh, params, opt = zero_adam(AxisType.Auto)
    grads = jax.jit(jax.grad(loss_fn))(params, *batch(mesh, 0))
    new = opt.update(grads, params)
    assert_shardings(new, named_shardings(SPECS, mesh))  # not ZeRO's data axis
    assert "data" in opt.opt_state[0].mu["w1"].sharding.spec
