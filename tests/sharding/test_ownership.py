"""Whole-leaf ownership: Muon's Newton-Schulz matrices computed each by one owner, on 8 virtual devices.

Under ZeRO-1 over ``data`` (and on any mesh of several devices) every matrix
a whole-leaf computation reads is computed by one device: the same params as
one device (rtol 1e-5: a stack of matrices may be multiplied in another order
than one matrix), no collective inside any loop, as many collectives at 10
Newton-Schulz steps as at 5, at most twice the params' bytes moved per step,
and a fraction of the one-device FLOPs on each device. The checks read the
compiled program's HLO. Model-sharded bf16 params with master weights, Kahan
or stochastic rounding are owned across all the mesh's devices and keep their
layout and one device's numbers.
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
from benchmarks import _hlo
from treeopt._sharding.ownership import owners, plan
from treeopt._sharding.whole_leaf import collected
from treeopt.partitioning import init_sharded, named_shardings, optimizer_shardings

from _helpers import device_mesh

AXIS_TYPES = ("auto", "explicit")
MATRICES = {f"layer{i}/kernel": (64, 64) for i in range(8)}
RTOL, ATOL = 1e-5, 1e-6


def make_params(shapes=MATRICES):
    keys = iter(jax.random.split(jax.random.key(0), len(shapes)))
    return {name: 0.1 * jax.random.normal(next(keys), shape) for name, shape in shapes.items()}


def grads_at(params, i):
    """Eager jax ops in the params' dtype, whatever array type holds them (numpy would round bf16 otherwise)."""
    return {name: jnp.sin(jnp.asarray(p) * (i + 2.0)) for name, p in params.items()}


def step(p, o, g):
    return o.update(g, p), o


def one_device(tx, params, steps):
    opt = treeopt.Optimizer(tx).init(params)
    for i in range(steps):
        params, opt = jax.jit(step)(params, opt, grads_at(params, i))
    return params, opt


def sharded(tx, params, mesh, steps, specs=None, over="data", **options):
    specs = specs or {name: P() for name in params}
    shardings = named_shardings(specs, mesh)
    placed = jax.device_put(params, shardings)
    opt = init_sharded(treeopt.Optimizer(tx, **options), placed, mesh, specs, shard_state_over=over)
    opt_shardings = optimizer_shardings(opt, specs, mesh, shard_state_over=over)
    jitted = jax.jit(
        step, in_shardings=(shardings, opt_shardings, shardings), out_shardings=(shardings, opt_shardings)
    )
    with jax.set_mesh(mesh):
        for i in range(steps):
            placed, opt = jitted(placed, opt, jax.device_put(grads_at(params, i), shardings))
            params = jax.tree.map(np.asarray, placed)
        program = _hlo.read(jitted.lower(placed, opt, placed).compile())
    return placed, opt, program


def assert_close(got, want):
    for name in want:
        np.testing.assert_allclose(
            np.asarray(got[name]), np.asarray(want[name]), rtol=RTOL, atol=ATOL, err_msg=name
        )


def params_bytes(params):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
def test_muon_under_zero_steps_as_one_device_with_one_exchange(axis_type):
    params = make_params()
    tx = optax.contrib.muon(1e-2)
    want, _ = one_device(tx, params, 3)
    got, _, program = sharded(tx, params, device_mesh((8,), ("data",), axis_type), 3)
    assert_close(got, want)
    assert program.in_loops() == []
    assert program.bytes() <= 2 * params_bytes(params), program.collectives
    reference = jax.jit(step).lower(params, treeopt.Optimizer(tx).init(params), params).compile()
    assert program.flops <= _hlo.read(reference).flops / 4  # each device: its own eighth of the matrices


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
def test_matrices_of_mixed_shapes_and_uneven_counts_step_as_one_device(axis_type):
    """Three squares, a wide and a tall matrix (stacked with the wide one, transposed) over 8 devices."""
    shapes = {
        "a": (64, 64),
        "b": (64, 64),
        "c": (64, 64),
        "wide": (64, 128),
        "tall": (128, 64),
        "bias": (64,),
    }
    params = make_params(shapes)
    tx = optax.contrib.muon(1e-2)
    want, _ = one_device(tx, params, 2)
    got, _, program = sharded(tx, params, device_mesh((8,), ("data",), axis_type), 2)
    assert_close(got, want)
    reference = jax.jit(step).lower(params, treeopt.Optimizer(tx).init(params), params).compile()
    # The dearest device does one 64 x 128 matrix (0.29 of them all); a device that computed the zeros its
    # stacks pad it with would do a square and a wide one (0.43).
    assert program.flops < _hlo.read(reference).flops / 3


PRECISIONS = {
    "master": {"master_dtype": jnp.float32},
    "kahan": {"param_rounding": "kahan"},
    "stochastic": {"param_rounding": "stochastic", "rounding_seed": 0},
}


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_model_sharded_bf16_params_are_owned_with_their_precision(axis_type, precision):
    """A 4 x 2 (data x model) mesh; kernels split over ``model`` by columns and by rows; bf16 params."""
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_params())
    specs = {name: P(None, "model") if i % 2 else P("model", None) for i, name in enumerate(params)}
    tx, options = optax.contrib.muon(1e-2), PRECISIONS[precision]
    opt = treeopt.Optimizer(tx, **options).init(params)
    want = params
    for i in range(3):
        want, opt = jax.jit(step)(want, opt, grads_at(want, i))
    mesh = device_mesh((4, 2), ("data", "model"), axis_type)
    got, got_opt, program = sharded(tx, params, mesh, 3, specs, **options)
    for name, spec in specs.items():
        assert got[name].sharding.spec == spec and got[name].dtype == jnp.bfloat16, name
    mine, theirs = got_opt.state_dict(), opt.state_dict()
    if precision == "kahan":  # a param and its compensation hold one float32 value between them
        for name in want:
            held = [
                np.asarray(p, np.float32) + np.asarray(c, np.float32)
                for p, c in (
                    (got[name], mine["compensation"].pop(name)),
                    (want[name], theirs["compensation"].pop(name)),
                )
            ]
            np.testing.assert_allclose(*held, rtol=RTOL, atol=ATOL, err_msg=name)
    else:  # bf16 params: one rounding of the new value apart at most (a bf16 ulp is 2**-7 of the value)
        for name in want:
            np.testing.assert_allclose(
                np.asarray(got[name], np.float32),
                np.asarray(want[name], np.float32),
                rtol=2**-7,
                err_msg=name,
            )
    # The float32 masters and momenta beneath the bf16 params, as one device holds them. Without masters
    # a param one rounding apart (above) feeds its next grad, sin(k p), up to k bf16 ulps apart, and the
    # momentum with it.
    rtol = RTOL if precision == "master" else 2**-6
    for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=ATOL)
    reference = jax.jit(step).lower(params, treeopt.Optimizer(tx, **options).init(params), params).compile()
    ratio = program.flops / _hlo.read(reference).flops
    assert ratio < 0.2, ratio  # an eighth of the matrices a device: owned across both axes, not per model shard


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
def test_more_newton_schulz_steps_add_no_collective(axis_type):
    params = make_params()
    counts = {}
    for ns_steps in (5, 10):
        tx = optax.contrib.muon(1e-2, ns_steps=ns_steps)
        _, _, program = sharded(tx, params, device_mesh((8,), ("data",), axis_type), 1)
        counts[ns_steps] = (program.count(), program.bytes())
    assert counts[10] == counts[5]


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
def test_gradient_accumulation_steps_as_one_device(axis_type):
    params = make_params()
    tx = optax.MultiSteps(optax.contrib.muon(1e-2), every_k_schedule=2)
    want, _ = one_device(tx, params, 4)
    got, _, program = sharded(tx, params, device_mesh((8,), ("data",), axis_type), 4)
    assert_close(got, want)
    reference = jax.jit(step).lower(params, treeopt.Optimizer(tx).init(params), params).compile()
    assert program.flops <= _hlo.read(reference).flops / 4  # owned inside the accumulation's lax.cond


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
def test_a_stacked_leaf_is_owned_slice_by_slice_where_it_lies(axis_type):
    """A scanned model's (8, 64, 64) kernel, split by ZeRO along its layers: each owner's slice, no exchange."""
    dims = {"stack": optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)}
    tx = optax.contrib.muon(1e-2, muon_weight_dimension_numbers=dims)
    params = make_params({"stack": (8, 64, 64)})
    want, _ = one_device(tx, params, 2)
    mesh = device_mesh((8,), ("data",), axis_type)
    got, opt, program = sharded(tx, params, mesh, 2)
    assert_close(got, want)
    # ZeRO's own rule would split the largest dimension (64); a stacked whole-leaf param's state splits by layer.
    assert opt.opt_state.inner_states["muon"].inner_state[0].mu["stack"].sharding.spec[0] == "data"
    assert program.count("all-to-all") == 0  # each device holds, and orthogonalizes, its own layer
    report = treeopt.partitioning.zero_report(opt, {"stack": P()}, mesh, "data")
    (owned,) = report.owned
    assert (owned.param, owned.matrices, owned.batch_axes, owned.owners) == (
        "stack",
        8,
        (0,),
        tuple(range(8)),
    )
    assert "stack  8 x (64, 64)     devices 0-7  (Muon's Newton-Schulz orthogonalization)" in str(report)


def test_state_dicts_load_between_owned_and_one_device():
    params = make_params()
    tx = optax.contrib.muon(1e-2)
    mesh = device_mesh((8,), ("data",), "explicit")
    _, owned, _ = sharded(tx, params, mesh, 2)
    plain = treeopt.Optimizer(tx).init(params).load_state_dict(owned.state_dict())
    for a, b in zip(jax.tree.leaves(plain.state_dict()), jax.tree.leaves(owned.state_dict()), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    back = owned.load_state_dict(plain.state_dict())
    for leaf, sharding in zip(
        jax.tree.leaves(back),
        jax.tree.leaves(optimizer_shardings(owned, {n: P() for n in params}, mesh, shard_state_over="data")),
        strict=True,
    ):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
def test_owned_false_leaves_the_matrices_to_optax_by_name_or_all(axis_type):
    params = make_params()
    tx = optax.contrib.muon(1e-2)
    want, _ = one_device(tx, params, 2)
    mesh = device_mesh((8,), ("data",), axis_type)
    _, _, owned = sharded(tx, params, mesh, 2)
    got, opt, everywhere = sharded(tx, params, mesh, 2, owned=False)
    assert_close(got, want)
    partial, opt, partly = sharded(tx, params, mesh, 2, owned={"layer0/*": False, "layer1/*": False})
    assert_close(partial, want)
    if axis_type == "explicit":  # optax's matmuls on the gathered momenta: every device computes all of them
        assert everywhere.flops > 4 * owned.flops
        assert owned.flops < partly.flops < everywhere.flops
    else:  # the compiler splits optax's matmuls over the ZeRO-split momenta, exchanging slices within
        assert everywhere.count() > 2 * owned.count()
        assert owned.count() < partly.count() < everywhere.count()
    report = treeopt.partitioning.zero_report(opt, {name: P() for name in params}, mesh, "data")
    where = {leaf.param: leaf.owners for leaf in report.owned}
    assert where["layer0/kernel"] == where["layer1/kernel"] == ()
    assert sorted(d for name, devices in where.items() for d in devices) == list(range(6))
    assert "layer0/kernel  (64, 64)         every device (not owned)" in str(report)


def test_owned_is_checked_and_named():
    for bad in ("yes", {"layer0/*": "no"}, {}, None):
        with pytest.raises(TypeError, match="owned must be True, False, or a mapping"):
            treeopt.Optimizer(optax.contrib.muon(1e-2), owned=bad)


# -- who owns what -------------------------------------------------------------------------------------


def test_the_plan_gives_the_dearest_matrices_first_to_the_least_loaded_device():
    assert plan([(1.0, 8)], devices=4) == [[2, 2, 2, 2]]
    # the dear ones first, one a device; then each cheap one to the least loaded device
    assert plan([(1.0, 5), (4.0, 2)], devices=4) == [[0, 0, 3, 2], [1, 1, 0, 0]]
    assert plan([(1.0, 3), (8.0, 1)], devices=2) == [[0, 3], [1, 0]]


def test_owners_balance_a_model_of_mixed_shapes():
    """A 4-layer transformer's matrices (attention, MLP in and out, embedding and head) over 8 devices."""
    shapes = {"embed": (512, 128), "head": (128, 512)}
    for layer in range(4):
        shapes |= {f"{layer}/{name}": (128, 128) for name in ("q", "k", "v", "o")}
        shapes |= {f"{layer}/mlp_in": (128, 512), f"{layer}/mlp_out": (512, 128)}
    params = {name: jnp.ones(shape) for name, shape in shapes.items()}
    tx = optax.contrib.muon(1e-2)
    with collected() as found:
        jax.eval_shape(tx.update, params, jax.eval_shape(tx.init, params), params)
    assert len(found) == len(shapes)
    work = [0.0] * 8
    for call, devices in zip(found, owners(found, 8), strict=True):
        _, m, n = call.matrix_shape()
        for d in devices:
            work[d] += call.entry.cost(m, n)
    assert max(work) / (sum(work) / 8) <= 1.25, work


# -- 8-bit momentum ------------------------------------------------------------------------------------

D_IN, HIDDEN = 64, 128
TEACHER = {
    "w1": jax.random.normal(jax.random.key(7), (D_IN, HIDDEN)) / D_IN**0.5,
    "w2": jax.random.normal(jax.random.key(8), (HIDDEN, D_IN)) / HIDDEN**0.5,
}


def mlp(params, x):
    return jnp.tanh(x @ params["w1"]) @ params["w2"]


def noisy_teacher_loss(params, x):
    """The teacher's outputs plus a part no student fits (a loss floor, as real data has)."""
    return jnp.mean((mlp(params, x) - mlp(TEACHER, x) - 0.3 * jnp.sin(17.0 * x)) ** 2)


def student():
    return {
        "w1": jax.random.normal(jax.random.key(1), (D_IN, HIDDEN)) / D_IN**0.5,
        "w2": jax.random.normal(jax.random.key(2), (HIDDEN, D_IN)) / HIDDEN**0.5,
    }


@pytest.mark.slow  # two 300-step trainings: the slow tier (-m slow) runs it
def test_8bit_muon_momentum_trains_like_float32():
    @jax.jit
    def train_step(params, opt, i):
        x = jax.random.normal(jax.random.fold_in(jax.random.key(1), i), (64, D_IN))
        loss, grads = jax.value_and_grad(noisy_teacher_loss)(params, x)
        return opt.update(grads, params), opt, loss

    final = {}
    for bits in (None, 8):
        params, opt, losses = (
            student(),
            treeopt.Optimizer(optax.contrib.muon(0.02), state_bits=bits).init(student()),
            [],
        )
        for i in range(300):
            params, opt, loss = train_step(params, opt, i)
            losses.append(float(loss))
        final[bits] = float(np.mean(losses[-50:]))
    assert type(opt.opt_state.inner_states["muon"].inner_state[0].mu["w1"]).__name__ == "QuantizedLeaf"
    assert abs(final[8] / final[None] - 1) < 0.01, final


def test_8bit_muon_momentum_is_owned_in_an_eighth_of_a_byte_a_param_per_device():
    mesh = device_mesh((8,), ("data",), "explicit")
    specs = {name: P() for name in TEACHER}
    params = jax.device_put(student(), named_shardings(specs, mesh))
    owned = init_sharded(
        treeopt.Optimizer(optax.contrib.muon(0.02), state_bits=8),
        params,
        mesh,
        specs,
        shard_state_over="data",
    )
    device = jax.devices()[0]
    held = sum(
        s.data.nbytes
        for x in jax.tree.leaves(owned.opt_state)
        for s in x.addressable_shards
        if s.device == device
    )
    assert held / sum(x.size for x in jax.tree.leaves(params)) <= 0.25
    with jax.set_mesh(mesh):
        for i in range(2):
            params, owned = jax.jit(step)(
                params, owned, jax.device_put(grads_at(student(), i), named_shardings(specs, mesh))
            )
    want, _ = one_device_8bit(student(), 2)
    assert_close(params, want)


def one_device_8bit(params, steps):
    opt = treeopt.Optimizer(optax.contrib.muon(0.02), state_bits=8).init(params)
    for i in range(steps):
        params, opt = jax.jit(step)(params, opt, grads_at(student(), i))
    return params, opt


# -- through the faces and checkpoints ------------------------------------------------------------------


def test_a_checkpoint_of_owned_state_restores_onto_half_the_devices_and_resumes(tmp_path):
    params = make_params()
    tx = optax.contrib.muon(1e-2)
    _, eight, _ = sharded(tx, params, device_mesh((8,), ("data",), "explicit"), 2)
    treeopt.checkpoint.save(tmp_path / "ckpt", eight)
    four = device_mesh((4,), ("data",), "default")
    specs = {name: P() for name in params}
    target = jax.eval_shape(treeopt.Optimizer(tx).init, params)
    shardings = optimizer_shardings(target, specs, four, shard_state_over="data")
    restored = treeopt.checkpoint.restore(tmp_path / "ckpt", target, shardings=shardings)
    for got, want in zip(
        jax.tree.leaves(restored.state_dict()), jax.tree.leaves(eight.state_dict()), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    after_two = one_device(tx, params, 2)[0]
    placed = jax.device_put(after_two, named_shardings(specs, four))
    grads = jax.device_put(grads_at(after_two, 2), named_shardings(specs, four))
    with jax.set_mesh(four):
        resumed, _ = jax.jit(step)(placed, restored, grads)
    assert_close(resumed, one_device(tx, params, 3)[0])


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
def test_the_nnx_drop_in_owns_muons_matrices_under_zero(axis_type):
    from flax import nnx

    params = make_params()

    class Layers(nnx.Module):
        def __init__(self, values):
            self.kernels = nnx.Dict({name.split("/")[0]: nnx.Param(value) for name, value in values.items()})

    mesh = device_mesh((8,), ("data",), axis_type)
    shardings = named_shardings({name: P() for name in params}, mesh)
    model = Layers(jax.device_put(params, shardings))
    optimizer = treeopt.nnx.Optimizer(model, optax.contrib.muon(1e-2), wrt=nnx.Param)
    specs = optimizer.partition_specs(
        jax.tree.map(lambda _: P(), nnx.state(model, nnx.Param)), shard_state_over="data", mesh=mesh
    )
    optimizer.treeopt.set_value(jax.device_put(optimizer.treeopt.get_value(), named_shardings(specs, mesh)))

    @nnx.jit
    def train_step(model, optimizer, i):
        grads = jax.tree.map(lambda p: jnp.sin(p * (i + 2.0)), nnx.state(model, nnx.Param))
        optimizer.update(model, grads)

    with jax.set_mesh(mesh):
        for i in range(2):
            train_step(model, optimizer, i)
    want, _ = one_device(optax.contrib.muon(1e-2), params, 2)
    assert_close({f"{name}/kernel": v[...] for name, v in model.kernels.items()}, want)


@pytest.mark.parametrize("axis_type", sorted(AXIS_TYPES))
def test_treeopt_t5x_owns_muons_matrices_under_its_zero(axis_type):
    import flax.linen as nn

    from treeopt.t5x import optimizers

    params = make_params()
    nested = {name.split("/")[0]: {"kernel": value} for name, value in params.items()}
    axes = jax.tree.map(lambda _: P("embed", "mlp"), nested)
    rules = [("batch", "data"), ("embed", None), ("mlp", None)]
    mesh = device_mesh((8,), ("data",), axis_type)
    opt_def = optimizers.OptaxWrapper(optax.contrib.muon(1e-2))
    logical = opt_def.derive_logical_axes(
        jax.eval_shape(opt_def.create, nested),
        axes,
        shard_state_over="batch",
        mesh=mesh,
        logical_axis_rules=rules,
    )
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, P() if s is None else nn.logical_to_mesh_axes(s, rules)),
        logical,
        is_leaf=lambda s: s is None or isinstance(s, P),
    )
    opt = jax.jit(opt_def.create, out_shardings=shardings)(nested)
    apply = jax.jit(lambda o, g: o.apply_gradient(g), out_shardings=shardings)
    with jax.set_mesh(mesh):
        for i in range(2):
            opt = apply(opt, jax.tree.map(lambda p, i=i: jnp.sin(p * (i + 2.0)), opt.target))
        program = _hlo.read(apply.lower(opt, opt.target).compile())
    want, _ = one_device(optax.contrib.muon(1e-2), params, 2)
    assert_close({f"{name}/kernel": leaf["kernel"] for name, leaf in opt.target.items()}, want)
    reference = jax.jit(step).lower(params, treeopt.Optimizer(optax.contrib.muon(1e-2)).init(params), params)
    assert program.flops <= _hlo.read(reference.compile()).flops / 4
