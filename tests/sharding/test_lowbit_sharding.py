"""Low-bit state on a mesh: ZeRO-1 and model-sharded params, auto and explicit axes, no rematerialization.

The sharded optimizer must step exactly as the unsharded one given the same
gradients: the blocks follow the arrays' shapes, not their shardings, and the
arithmetic of a step is elementwise or a maximum, which splitting does not
change. The codes and scales of a param split on one of its axes, and every
leaf of a param takes the same axis, so the arithmetic between a moment, a
master copy and a Kahan compensation never needs a reshard (the source of
XLA's "Involuntary full rematerialization" warnings).
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

from _helpers import device_mesh

SPECS = {"w": P(), "v": P(), "m": P(None, "model")}


def _params(dtype):
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = {"w": (256, 512), "v": (4096,), "m": (128, 256)}
    return {name: jax.random.normal(k, shapes[name]).astype(dtype) for k, name in zip(keys, shapes, strict=True)}


def _spec(x):
    entries = list(x.spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _options(precision):
    if precision == "master":
        return {"master_dtype": jnp.float32}
    return {"param_rounding": precision} if precision else {}


@pytest.mark.parametrize(
    ("axis_type", "bits", "precision"),
    [
        (AxisType.Explicit, 8, None),
        (AxisType.Explicit, 4, "kahan"),
        (AxisType.Explicit, 8, "master"),
        (AxisType.Auto, 8, "kahan"),
        (AxisType.Auto, 4, "stochastic"),
    ],
)
def test_zero_and_model_sharded_low_bit_state_steps_exactly_as_unsharded(axis_type, bits, precision):
    mesh = device_mesh((4, 2), ("data", "model"), axis_type)
    dtype = jnp.bfloat16 if precision else jnp.float32
    params = _params(dtype)
    shardings = {k: NamedSharding(mesh, s) for k, s in SPECS.items()}
    tx = optax.adamw(1e-2)
    options = {"state_bits": bits, **_options(precision)}
    plain = treeopt.Optimizer(tx, **options).init(params)
    sharded = treeopt.partitioning.init_sharded(
        treeopt.Optimizer(tx, **options), jax.device_put(params, shardings), mesh, SPECS, shard_state_over="data"
    )
    step = jax.jit(lambda p, o, g: (o.update(g, p), o))
    p1, p2 = params, jax.device_put(params, shardings)
    for i in range(3):
        grads = {k: jax.random.normal(jax.random.key(10 + i), v.shape).astype(v.dtype) for k, v in params.items()}
        p1, plain = step(p1, plain, grads)
        p2, sharded = step(p2, sharded, jax.device_put(grads, shardings))
    for name in params:
        np.testing.assert_array_equal(np.asarray(p1[name], np.float32), np.asarray(p2[name], np.float32), err_msg=name)
        if axis_type == AxisType.Explicit:  # (under auto axes, jit's out_shardings decide)
            assert _spec(p2[name].sharding) == _spec(shardings[name]), name  # each param keeps its sharding
    mu = sharded.opt_state[0].mu
    split = {"w": True, "v": bits == 8, "m": True}  # a 4-bit 1-d leaf pairs its halves: it stays whole
    for name, q in mu.items():
        held = q.codes.addressable_shards[0].data.nbytes
        assert (held < q.codes.nbytes) == split[name], (name, held, q.codes.nbytes)


def test_the_model_axis_splits_the_codes_of_a_model_sharded_param():
    mesh = device_mesh((4, 2), ("data", "model"), "explicit")
    opt = treeopt.Optimizer(optax.adam(1e-3), state_bits=8).init(_params(jnp.float32))
    specs = opt.partition_specs(SPECS, mesh=mesh)
    m, w = specs.opt_state[0].mu["m"], specs.opt_state[0].mu["w"]
    assert m.codes == P(None, "model")  # 8-bit codes take their param's spec
    assert m.scales == P()  # a block is a row of 256: a model shard of 128 cuts it, its scale is on both
    zero = opt.partition_specs({**SPECS, "w": P(None, "model")}, shard_state_over="data", mesh=mesh)
    assert zero.opt_state[0].mu["m"].codes == P("data", "model") and zero.opt_state[0].mu["m"].scales == P("data")
    # (256, 512) in blocks of 256: a model shard of 256 holds whole blocks, and so does its scale
    assert zero.opt_state[0].mu["w"].codes == P("data", "model") and zero.opt_state[0].mu["w"].scales == P("data", "model")
    assert w.codes == P() and w.scales == P()


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_a_bf16_kahan_8bit_zero_program_compiles_without_involuntary_rematerialization(axis_type, capfd):
    mesh = device_mesh((8,), ("data",), axis_type)
    params = jax.device_put(_params(jnp.bfloat16), NamedSharding(mesh, P()))
    specs = jax.tree.map(lambda _: P(), params)
    opt = treeopt.partitioning.init_sharded(
        treeopt.Optimizer(optax.adamw(1e-3), state_bits=8, param_rounding="kahan"),
        params,
        mesh,
        specs,
        shard_state_over="data",
    )

    def step(p, o, x):
        grads = jax.grad(lambda p: sum(jnp.sum(jnp.sin(v.astype(jnp.float32) * x)) for v in jax.tree.leaves(p)))(p)
        return o.update(grads, p), o

    capfd.readouterr()
    jax.jit(step).lower(params, opt, jnp.float32(0.5)).compile()
    logged = capfd.readouterr().err
    assert "Involuntary full rematerialization" not in logged, logged[-3000:]


def _steps(opt, params, grads_of, n, shardings=None):
    step = jax.jit(lambda p, o, g: (o.update(g, p), o))
    for i in range(n):
        grads = grads_of(i)
        params, opt = step(params, opt, grads if shardings is None else jax.device_put(grads, shardings))
    return params, opt


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize(
    ("shape", "spec", "bits"),
    [
        ((64, 512), P(None, "model"), 8),  # blocks of 256, model shards of 128
        ((64, 200), P(None, "model"), 8),  # one block a row, model shards of 50
        ((8192,), P("model"), 4),  # 4-bit bytes pair the halves of the one row
    ],
    ids=["rows-of-two-blocks", "one-short-block", "1d-4bit"],
)
def test_blocks_cut_by_a_model_shard_step_as_one_device(axis_type, shape, spec, bits):
    mesh = device_mesh((2, 4), ("data", "model"), axis_type)
    shardings = {"w": NamedSharding(mesh, spec)}
    params = {"w": jax.random.normal(jax.random.key(0), shape)}
    options = {"state_bits": bits, "param_rounding": None}
    sharded = treeopt.partitioning.init_sharded(
        treeopt.Optimizer(optax.adam(1e-2), **options),
        jax.device_put(params, shardings),
        mesh,
        {"w": spec},
        shard_state_over="data",
    )
    state_shardings = treeopt.partitioning.optimizer_shardings(sharded, {"w": spec}, mesh, shard_state_over="data")
    plain = treeopt.Optimizer(optax.adam(1e-2), **options).init(params)

    def grads_of(i):
        return {"w": jnp.sin(params["w"] * (i + 1.5))}

    want, plain = _steps(plain, params, grads_of, 3)
    with jax.set_mesh(mesh):
        got, sharded = _steps(sharded, jax.device_put(params, shardings), grads_of, 3, shardings)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(want["w"]))
    for moment in ("mu", "nu"):
        q, ref = getattr(sharded.opt_state[0], moment)["w"], getattr(plain.opt_state[0], moment)["w"]
        np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(ref.codes))
        np.testing.assert_array_equal(np.asarray(q.scales), np.asarray(ref.scales))
    if axis_type == AxisType.Explicit:  # the state keeps its layout, the param its own
        for leaf, sharding in zip(jax.tree.leaves(sharded), jax.tree.leaves(state_shardings), strict=True):
            assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (leaf.sharding, sharding)
        assert got["w"].sharding.is_equivalent_to(shardings["w"], len(shape))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_a_row_split_kernel_splits_its_low_bit_state_over_data_too(axis_type):
    mesh = device_mesh((4, 2), ("data", "model"), axis_type)
    specs = {"w": P("model", None)}  # (512, 64) split by rows: an MLP's down projection
    params = jax.device_put({"w": jnp.ones((512, 64), jnp.bfloat16)}, NamedSharding(mesh, specs["w"]))
    tx = optax.adam(1e-3)
    opt = treeopt.partitioning.init_sharded(
        treeopt.Optimizer(tx, state_bits=8, param_rounding="kahan"), params, mesh, specs, shard_state_over="data"
    )
    report = treeopt.partitioning.zero_report(opt, specs, mesh, "data")
    by_path = {leaf.path: leaf for leaf in report.leaves}
    for path in ("opt_state[0].mu['w'].codes", "opt_state[0].nu['w'].scales", "rounding['compensation']['w']"):
        leaf = by_path[path]
        assert (leaf.dim, leaf.reason) == (0, None), leaf  # the rows: "data" joins "model" there
        assert leaf.zero_spec[0] == ("model", "data"), leaf
    codes = opt.opt_state[0].mu["w"].codes
    assert codes.addressable_shards[0].data.nbytes * 8 == codes.nbytes  # device 0 holds 1/8 of the codes
    grads = jax.device_put({"w": jnp.full((512, 64), 0.5, jnp.bfloat16)}, NamedSharding(mesh, specs["w"]))
    with jax.set_mesh(mesh):
        new, opt = jax.jit(lambda p, o, g: (o.update(g, p), o))(params, opt, grads)
    if axis_type == AxisType.Explicit:  # (under auto axes, jit's out_shardings decide)
        assert new["w"].sharding.is_equivalent_to(NamedSharding(mesh, specs["w"]), 2)
    assert "data" in str(opt.opt_state[0].mu["w"].codes.sharding.spec)


def test_a_4bit_leaf_whose_bytes_span_the_shards_says_so():
    mesh = device_mesh((4, 2), ("data", "model"), "explicit")
    opt = jax.eval_shape(treeopt.Optimizer(optax.adam(1e-3), state_bits=4).init, {"v": jnp.ones(4096)})
    report = treeopt.partitioning.zero_report(opt, {"v": P()}, mesh, "data")
    reasons = {leaf.path: leaf.reason for leaf in report.leaves}
    # 4-bit bytes pair the two halves of the one row: no shard may take part of it.
    assert reasons["opt_state[0].mu['v'].codes"] == "a shard would cut its low-bit blocks"


def test_warm_start_from_live_zero_low_bit_state_is_the_same_on_both_axis_types():
    results = {}
    for axis_type in (AxisType.Auto, AxisType.Explicit):
        mesh = device_mesh((8,), ("data",), axis_type)
        specs = {"w": P(), "v": P()}
        shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
        params = jax.device_put({"w": jnp.ones((64, 64)), "v": jnp.ones(8192)}, shardings)
        source = treeopt.partitioning.init_sharded(
            treeopt.Optimizer(optax.adam(1e-2), state_bits=8), params, mesh, specs, shard_state_over="data"
        )
        grads = jax.device_put({"w": jnp.full((64, 64), 0.3), "v": jnp.linspace(-1, 1, 8192)}, shardings)
        with jax.set_mesh(mesh):
            _, source = _steps(source, params, lambda i, g=grads: g, 2)
        target = treeopt.partitioning.init_sharded(
            treeopt.Optimizer(optax.adam(1e-2), state_bits=4), params, mesh, specs, shard_state_over="data"
        )
        target_shardings = treeopt.partitioning.optimizer_shardings(target, specs, mesh, shard_state_over="data")
        warm, report = treeopt.serialization.warm_start(target, source.state_dict())
        assert len(report.converted) == 4  # mu and nu of both params: 8-bit codes to 4-bit codes
        for leaf, sharding in zip(jax.tree.leaves(warm), jax.tree.leaves(target_shardings), strict=True):
            assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
        results[axis_type] = warm
    for got, want in zip(*(jax.tree.leaves(results[t]) for t in results), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
class _Lookalike:
    """An object with a low-bit leaf's two method names, but no part of its contract."""

    shape = (4, 8)
    dtype = jnp.dtype(jnp.float32)

    def partition_specs(self, param_spec, axis_sizes=None):
        raise AssertionError("asked for its specs")

    def zero_axes(self, param_spec, shards):
        raise AssertionError("asked for its ZeRO axes")


def test_only_a_leaf_that_subclasses_the_spec_contract_is_asked_for_its_specs():
    from treeopt._lowbit import quantize
    from treeopt._sharding.specs import SpecifiesItself, is_self_specified, state_leaf_specs
    from treeopt.layout import ParamLayout

    assert is_self_specified(quantize(jnp.ones((4, 64)), bits=8)) and not is_self_specified(_Lookalike())
    layout = ParamLayout.of({"w": jnp.ones((4, 8))})
    _, [leaf] = state_leaf_specs({"w": _Lookalike()}, layout, {"w": P("data", "model")}, {"data": 2, "model": 2})
    assert leaf.spec == P("data", "model")  # the spec of any leaf shaped like its param: its methods unasked
    with pytest.raises(TypeError, match="abstract"):
        SpecifiesItself()  # the contract is abstract: its methods must be written
