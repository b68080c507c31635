"""Owned matrices wherever a Muon user trains: data x model meshes, stacked leaves, wrappers, own functions.

Every case compares with one device (rtol 1e-5, atol 1e-6: an owner may
multiply a matrix as its transpose, or a stack in another order), on both
axis types where both apply. The compiled program is read for its
collectives, their bytes and its FLOPs; XLA's warnings of involuntary
rematerialization are read from the compile's own output.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_ownership import assert_close, params_bytes, sharded

import treeopt
from benchmarks import _hlo
from treeopt._sharding.whole_leaf import collected, registered
from treeopt.partitioning import init_sharded, named_shardings, zero_report

from _helpers import device_mesh

AXIS_TYPES = ("auto", "explicit")
REMAT = "Involuntary full rematerialization"


def make_params(shapes, seed=0):
    keys = iter(jax.random.split(jax.random.key(seed), len(shapes)))
    return {name: 0.1 * jax.random.normal(next(keys), shape) for name, shape in shapes.items()}


def grads_at(params, i):
    return {name: jnp.sin(jnp.asarray(p) * (i + 2.0)) for name, p in params.items()}


def step(p, o, g):
    return o.update(g, p), o


def one_device(tx, params, steps, **options):
    opt = treeopt.Optimizer(tx, **options).init(params)
    for i in range(steps):
        params, opt = jax.jit(step)(params, opt, grads_at(params, i))
    return params


def on_mesh(tx, params, mesh, specs, steps, over="data", **options):
    """``steps`` jitted steps on ``mesh`` and the compiled program, compiled afresh so that its warnings print."""
    with uncached():
        return sharded(tx, params, mesh, steps, specs, over, **options)


@contextlib.contextmanager
def uncached():
    """A compile that runs, so that its warnings are printed (a cache hit prints nothing)."""
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)


def transformer(d=64, layers=2):
    """A layer's q, k, v, up split by columns over ``model``, o and down by rows."""
    shapes, specs = {}, {}
    for layer in range(layers):
        for name in ("q", "k", "v", "up"):
            shapes[f"l{layer}/{name}"] = (d, 4 * d if name == "up" else d)
            specs[f"l{layer}/{name}"] = P(None, "model")
        for name in ("o", "down"):
            shapes[f"l{layer}/{name}"] = (4 * d if name == "down" else d, d)
            specs[f"l{layer}/{name}"] = P("model", None)
    return shapes, specs


# -- data x model ------------------------------------------------------------------------------------


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
def test_a_data_by_model_mesh_moves_at_most_a_quarter_more_than_the_params(axis_type, capfd):
    shapes, specs = transformer()
    params = make_params(shapes)
    tx = optax.contrib.muon(1e-2)
    want = one_device(tx, params, 2)
    mesh = device_mesh((4, 2), ("data", "model"), axis_type)
    capfd.readouterr()
    got, _, program = on_mesh(tx, params, mesh, specs, 2)
    assert REMAT not in capfd.readouterr().err
    assert_close(got, want)
    assert program.in_loops() == []
    assert program.bytes() <= 1.25 * params_bytes(params), program.collectives
    for name, x in got.items():  # the params keep their layout
        assert x.sharding == NamedSharding(mesh, specs[name]), name
    reference = jax.jit(step).lower(params, treeopt.Optimizer(tx).init(params), params).compile()
    assert program.flops <= _hlo.read(reference).flops / 4


# -- stacked and folded leaves -------------------------------------------------------------------------


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
@pytest.mark.parametrize(
    ("mesh_shape", "layers", "spec"),
    [
        ((2, 4), 4, P("x", None, None)),
        ((2, 4), 6, P("x", None, None)),
        ((2, 4), 12, P("x", None, "y")),
        ((8, 1), 12, P(None, None, None)),
    ],
)
def test_stacked_leaves_split_on_any_axis_step_as_one_device(axis_type, mesh_shape, layers, spec):
    shapes = {"stack": (layers, 16, 32), "single": (32, 16)}
    params = make_params(shapes)
    dims = {"stack": optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2), "single": None}
    tx = optax.contrib.muon(1e-2, muon_weight_dimension_numbers=dims)
    want = one_device(tx, params, 2)
    mesh = device_mesh(mesh_shape, ("x", "y"), axis_type)
    specs = {"stack": spec, "single": P()}
    got, _, program = on_mesh(tx, params, mesh, specs, 2, over="x")
    assert_close(got, want)
    assert program.in_loops() == []


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
def test_a_3d_leaf_folded_into_one_matrix_steps_as_one_device(axis_type):
    shapes = {"heads": (4, 8, 32), "w": (32, 32)}
    params = make_params(shapes)
    dims = {"heads": optax.contrib.MuonDimensionNumbers(reduction_axis=(0, 1), output_axis=2), "w": None}
    tx = optax.contrib.muon(1e-2, muon_weight_dimension_numbers=dims)
    want = one_device(tx, params, 2)
    mesh = device_mesh((4, 2), ("data", "model"), axis_type)
    specs = {"heads": P(None, None, "model"), "w": P(None, "model")}
    got, _, program = on_mesh(tx, params, mesh, specs, 2)
    assert_close(got, want)
    assert program.in_loops() == []


# -- meshes of one device, unplaced values ---------------------------------------------------------------


def test_a_1x1_explicit_mesh_steps_as_one_device():
    params = make_params({"w": (16, 32), "v": (32, 16)})
    tx = optax.contrib.muon(1e-2)
    want = one_device(tx, params, 2)
    mesh = device_mesh((1, 1), ("data", "model"), "explicit")
    got, _, _ = on_mesh(tx, params, mesh, {"w": P("data", "model"), "v": P("model", "data")}, 2)
    assert_close(got, want)


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
def test_an_eager_update_with_unplaced_grads_steps_as_one_device(axis_type):
    params = make_params({"w": (16, 32), "b": (32,)})
    tx = optax.contrib.muon(1e-2)
    opt = treeopt.Optimizer(tx).init(params)
    want = opt.update(jax.tree.map(np.asarray, grads_at(params, 0)), params)
    mesh = device_mesh((8,), ("data",), axis_type)
    specs = {"w": P(), "b": P()}
    placed = jax.device_put(params, named_shardings(specs, mesh))
    zero = init_sharded(treeopt.Optimizer(tx), placed, mesh, specs, shard_state_over="data")
    with jax.set_mesh(mesh):
        got = zero.update(jax.tree.map(np.asarray, grads_at(params, 0)), placed)
    assert_close(got, want)


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
def test_an_unplaced_optimizer_of_multisteps_steps_eagerly_under_a_mesh_context(axis_type):
    params = make_params({"w": (16, 32), "b": (32,)})
    tx = optax.MultiSteps(optax.contrib.muon(1e-2), every_k_schedule=2)
    want = one_device(tx, params, 3)
    opt = treeopt.Optimizer(tx).init(params)
    got = params
    with jax.set_mesh(device_mesh((8,), ("data",), axis_type)):
        for i in range(3):
            got = opt.update(grads_at(got, i), got)
    assert_close(got, want)


# -- whole-leaf calls inside the transformation's own control flow -----------------------------------------


WRAPPERS = {
    "apply_if_finite": lambda tx: optax.apply_if_finite(tx, max_consecutive_errors=3),
    "conditionally_transform": lambda tx: optax.conditionally_transform(
        tx, should_transform_fn=lambda count: count % 2 == 0
    ),
    "MultiSteps": lambda tx: optax.MultiSteps(tx, every_k_schedule=2),
}


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
@pytest.mark.parametrize("owned", [True, False])
def test_whole_leaf_calls_inside_control_flow_step_as_one_device(axis_type, wrapper, owned):
    params = make_params({"a": (16, 32), "b": (32, 16), "bias": (32,)})
    tx = WRAPPERS[wrapper](optax.contrib.muon(1e-2))
    want = one_device(tx, params, 3)
    specs = {name: P() for name in params}
    got, _, program = on_mesh(tx, params, device_mesh((8,), ("data",), axis_type), specs, 3, owned=owned)
    assert_close(got, want)
    assert program.in_loops() == []


# -- calls matched to params by data flow ------------------------------------------------------------------


def test_calls_are_matched_by_the_gradient_they_compute_from_not_by_shape():
    shapes = {"a_kernel": (16, 16), "b_kernel": (16, 16), "c_kernel": (16, 16), "d_stack": (2, 16, 16)}
    params = make_params(shapes)
    labels = {"a_kernel": "adam", "b_kernel": "muon", "c_kernel": "muon2", "d_stack": "muon"}
    matrix = optax.contrib.MuonDimensionNumbers()
    dims = {"a_kernel": None, "b_kernel": matrix, "c_kernel": None, "d_stack": None}  # d_stack: Muon's Adam
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),  # every clipped gradient reads every gradient's norm
        optax.multi_transform(
            {
                "adam": optax.adam(1e-3),
                "muon": optax.contrib.muon(1e-2, muon_weight_dimension_numbers=dims),
                "muon2": optax.contrib.muon(2e-2),
            },
            labels,
        ),
    )
    mesh = device_mesh((8,), ("data",), "explicit")
    opt = treeopt.Optimizer(tx, owned={"b_kernel": False}).init(params)
    report = zero_report(opt, {name: P() for name in params}, mesh, shard_state_over="data")
    named = {leaf.param: bool(leaf.owners) for leaf in report.owned}
    assert named == {"b_kernel": False, "c_kernel": True}
    want = one_device(tx, params, 2)
    got, _, _ = on_mesh(tx, params, mesh, {name: P() for name in params}, 2, owned={"b_kernel": False})
    assert_close(got, want)


def test_owned_globs_are_checked_as_state_bits_globs_are():
    params = make_params({"up": (16, 32), "down": (32, 16)})
    tx = optax.contrib.muon(1e-2)
    with pytest.raises(ValueError, match=r"owned: the glob 'up' comes after '\*'"):
        treeopt.Optimizer(tx, owned={"*": True, "up": False}).init(params)
    with pytest.raises(ValueError, match=r"owned: the glob\(s\) \['upp'\] match no trained parameter"):
        treeopt.Optimizer(tx, owned={"upp": False}).init(params)
    treeopt.Optimizer(tx, owned={"up": False, "*": True}).init(params)


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
def test_with_nothing_to_own_the_update_is_traced_once(axis_type):
    params = make_params({"w": (16, 32), "b": (32,)})
    adam = optax.adam(1e-3)
    traced = []

    def update(updates, state, params=None):
        traced.append(1)
        return adam.update(updates, state, params)

    tx = optax.GradientTransformation(adam.init, update)
    mesh = device_mesh((8,), ("data",), axis_type)
    specs = {"w": P(), "b": P()}
    placed = jax.device_put(params, named_shardings(specs, mesh))
    opt = init_sharded(treeopt.Optimizer(tx), placed, mesh, specs, shard_state_over="data")
    traced.clear()
    with jax.set_mesh(mesh):
        jax.jit(step).lower(placed, opt, placed)
    assert len(traced) == 1


# -- your own whole-leaf function ------------------------------------------------------------------------


@treeopt.whole_leaf
def cubic_orthogonalize(g, steps=6):
    """A user's own orthogonalizer: the cubic Newton-Schulz iteration, on a matrix with rows <= columns."""
    x = g / (jnp.linalg.norm(g) + 1e-7)
    for _ in range(steps):
        x = 1.5 * x - 0.5 * (x @ x.T) @ x
    return x


def orthogonalized_momentum(learning_rate, beta=0.9):
    def init(params):
        return jax.tree.map(jnp.zeros_like, params)

    def update(updates, state, params=None):
        momentum = jax.tree.map(lambda m, g: beta * m + g, state, updates)
        directions = jax.tree.map(cubic_orthogonalize, momentum)
        return jax.tree.map(lambda d: -learning_rate * d, directions), momentum

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
def test_a_users_own_orthogonalizer_is_owned_at_a_quarter_of_the_flops(axis_type):
    params = make_params({f"layer{i}/kernel": (64, 128) for i in range(8)})
    tx = orthogonalized_momentum(1e-2)
    want = one_device(tx, params, 2)
    mesh = device_mesh((8,), ("data",), axis_type)
    got, _, program = on_mesh(tx, params, mesh, {name: P() for name in params}, 2)
    assert_close(got, want)
    assert program.in_loops() == []
    reference = jax.jit(step).lower(params, treeopt.Optimizer(tx).init(params), params).compile()
    assert program.flops <= _hlo.read(reference).flops / 4


def test_whole_leaf_marks_a_function_and_names_bad_options():
    x = jnp.eye(3) * 2.0
    np.testing.assert_allclose(cubic_orthogonalize(x), jnp.eye(3), rtol=1e-3)  # off a mesh: itself
    with collected() as calls:
        cubic_orthogonalize(x)
    assert [call.entry.leaf for call in calls] == ["g"]
    with pytest.raises(TypeError, match="no argument 'm'"):
        treeopt.whole_leaf(lambda g: g, leaf="m")
    with pytest.raises(ValueError, match="no function 'nope' in module 'optax'"):
        treeopt.whole_leaf(module="optax", name="nope")
    with pytest.raises(TypeError, match="cost must be a function"):
        treeopt.whole_leaf(lambda g: g, cost=3)


def test_optax_newton_schulz_is_registered_where_optax_calls_it():
    """Fails if optax moves or renames its Newton-Schulz: Muon's calls would no longer be found."""
    assert [(e.module, e.name) for e in registered()] == [
        ("optax.contrib._muon", "orthogonalize_via_newton_schulz")
    ]
    params = {"w": jnp.ones((4, 8)), "b": jnp.ones(8)}
    tx = optax.contrib.muon(1e-2)
    with collected() as calls:
        tx.update(params, tx.init(params), params)
    assert [tuple(call.leaf.shape) for call in calls] == [(4, 8)]
    assert calls[0].entry.transposable


def test_the_registered_function_is_optax_own_outside_an_update():
    from optax.contrib import _muon

    original = registered()[0].original
    assert _muon.orthogonalize_via_newton_schulz is original
    with collected():
        assert _muon.orthogonalize_via_newton_schulz is not original
    assert _muon.orthogonalize_via_newton_schulz is original
