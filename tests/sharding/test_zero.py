"""ZeRO-1: the optimizer state split over the data-parallel axis with ``shard_state_over``.

On the 8 virtual CPU devices, two meshes: ``data=8`` with replicated params,
and ``data=4 x model=2`` with params sharded over ``model``. Checked: which
leaf gets the axis on which dimension (against an independent statement of
the rule, for every transformation of the parity list), the bytes device 0
holds, that 20 jitted steps give the numbers of the unsharded run, that the
compiled step's arguments and outputs shrink, and that a ZeRO-sharded
checkpoint restores into a ZeRO-sharded, a replicated and a smaller mesh.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import DictKey
from test_partitioning import PARAM_SPECS as PARITY_PARAM_SPECS
from test_partitioning import TRANSFORMATIONS as PARITY_TRANSFORMATIONS
from test_partitioning import make_params as make_parity_params

import treeopt
from treeopt.partitioning import (
    init_sharded,
    named_shardings,
    optimizer_shardings,
    optimizer_specs,
    zero_report,
)

from _helpers import device_mesh

STEPS = 20
RTOL, ATOL = 1e-6, 1e-7

SHAPES = {
    "embed": (64, 16),
    "dense": {"kernel": (16, 32), "bias": (32,)},
    "head": {"kernel": (32, 10)},
    "norm": {"scale": (6,)},
    "odd": (12, 10),
    "gain": (),
}
# data=8, params replicated.
SPECS_1D = jax.tree.map(lambda _: P(), SHAPES, is_leaf=lambda x: isinstance(x, tuple))
# data=4 x model=2, params sharded over "model" where it divides.
SPECS_2D = {
    "embed": P(None, "model"),
    "dense": {"kernel": P(None, "model"), "bias": P("model")},
    "head": {"kernel": P("model", None)},
    "norm": {"scale": P()},
    "odd": P(),
    "gain": P(),
}


def make_params():
    keys = iter(jax.random.split(jax.random.key(0), 8))
    return jax.tree.map(
        lambda shape: 0.5 * jax.random.normal(next(keys), shape),
        SHAPES,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def mesh_1d():
    return device_mesh((8,), ("data",))


def mesh_2d():
    return device_mesh((4, 2), ("data", "model"))


MESHES = {"data=8": (mesh_1d, SPECS_1D), "data=4 x model=2": (mesh_2d, SPECS_2D)}

TRANSFORMATIONS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw_masked": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=treeopt.mask("*kernel", "embed")),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
    "multi_transform": lambda: optax.multi_transform(
        {"adam": optax.adam(1e-2), "sgd": optax.sgd(1e-2, momentum=0.9)},
        treeopt.labels({"*kernel": "adam", "embed": "adam"}, default="sgd"),
    ),
}


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["embed"])
    h = jnp.tanh(h @ params["dense"]["kernel"] + params["dense"]["bias"])
    out = h @ params["head"]["kernel"] * params["gain"]
    loss = jnp.mean((out - y) ** 2)
    loss += jnp.mean(params["odd"] ** 2) * jnp.mean(x**2) + jnp.sum(params["norm"]["scale"] * h[0, :6])
    return loss


def batch(i):
    rng = np.random.default_rng(i)
    return rng.standard_normal((32, 64)).astype(np.float32), rng.standard_normal((32, 10)).astype(np.float32)


def train_step(params, opt, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    return opt.update(grads, params), opt


def device0_bytes(tree):
    """Bytes of ``tree``'s arrays held by device 0 (its addressable shards there)."""
    device = jax.devices()[0]
    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(tree)
        for shard in leaf.addressable_shards
        if shard.device == device
    )


def axes_of(entry):
    return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def padded(spec, rank):
    return [*spec, *([None] * (rank - len(spec)))]


# -- the rule, leaf by leaf -----------------------------------------------------------


def owner_of(path, names):
    keys = [k.key for k in path if isinstance(k, DictKey) and k.key in names]
    return keys[-1] if keys else None


def check_zero_rule(opt, base, zero, axes, sizes, owned=()):
    """Each leaf: unchanged, or the base spec plus the axes it lacks on its largest free dimension they
    divide; where no free dimension takes them, joined to the axes of the sharded dimension whose
    per-device slice stays largest. An owned param's leaves shaped like it (``owned``: the params whose
    matrices an owner computes, on an auto-axes mesh): all the mesh's axes on its largest dimension they
    divide, the last of equals, where the owners' exchange takes them to lie."""
    names = set(opt.paths)
    shapes = {name: tuple(shape) for name, (shape, _) in zip(opt.layout.names, opt.layout.avals, strict=True)}
    flat = jax.tree_util.tree_flatten_with_path(opt.opt_state)[0]
    base_leaves, zero_leaves = jax.tree.leaves(base.opt_state), jax.tree.leaves(zero.opt_state)
    assert len(flat) == len(base_leaves) == len(zero_leaves)
    assert jax.tree.structure(zero) == jax.tree.structure(opt)
    assert zero.step == P()
    split = 0
    for (path, leaf), b, z in zip(flat, base_leaves, zero_leaves, strict=True):
        where = jax.tree_util.keystr(path)
        shape = tuple(leaf.shape)
        bp, zp = padded(b, len(shape)), padded(z, len(shape))
        used = {a for e in bp for a in axes_of(e)}
        missing = [a for a in axes if a not in used]
        n = math.prod(sizes[a] for a in missing)
        free = [d for d in range(len(shape)) if bp[d] is None]
        fits = [d for d in free if shape[d] >= n and shape[d] % n == 0]
        parts = {d: n * math.prod(sizes[a] for a in axes_of(bp[d])) for d in range(len(shape)) if bp[d]}
        joins = [d for d, k in parts.items() if shape[d] % k == 0]
        eligible = (
            owner_of(path, names) is not None
            and jnp.issubdtype(leaf.dtype, jnp.inexact)
            and missing
            and math.prod(shape) > 0
            and (fits or joins)
        )
        param = owner_of(path, names)
        if param in owned and shape == shapes[param]:
            devices = math.prod(sizes.values())
            dim = max((d for d in range(len(shape)) if shape[d] % devices == 0), key=lambda d: (shape[d], d))
            assert zp == [None] * dim + [tuple(sizes)] + [None] * (len(shape) - dim - 1), f"{where}: {z}"
            split += 1
            continue
        if not eligible:
            assert zp == bp, f"{where} {shape}: {b} became {z}"
            continue
        want = list(bp)
        if fits:
            best = max(shape[d] for d in fits)
            dim = min(d for d in fits if shape[d] == best)
            want[dim] = missing[0] if len(missing) == 1 else tuple(missing)
        else:
            best = max(shape[d] // parts[d] for d in joins)
            dim = min(d for d in joins if shape[d] // parts[d] == best)
            want[dim] = (*axes_of(bp[dim]), *missing)
        assert zp == want, f"{where} {shape}: got {z}, expected {want}"
        split += 1
    return split


@pytest.mark.parametrize("name", sorted(PARITY_TRANSFORMATIONS))
def test_every_transformation_follows_the_rule(name):
    # The parity list of tests/sharding/test_partitioning.py, on its (data=2, model=4) specs.
    opt = jax.eval_shape(treeopt.Optimizer(PARITY_TRANSFORMATIONS[name]()).init, make_parity_params())
    mesh = device_mesh((2, 4), ("data", "model"))
    base = optimizer_specs(opt, PARITY_PARAM_SPECS)
    for over in ("data", "model", ("data", "model")):
        zero = optimizer_specs(opt, PARITY_PARAM_SPECS, shard_state_over=over, mesh=mesh)
        axes = (over,) if isinstance(over, str) else over
        report = zero_report(opt, PARITY_PARAM_SPECS, mesh, over)
        owned = {leaf.param for leaf in report.owned if leaf.owners}
        assert bool(owned) == (name == "muon"), owned
        check_zero_rule(opt, base, zero, axes, dict(mesh.shape), owned)
        for spec in jax.tree.leaves(zero):
            NamedSharding(mesh, spec)  # a valid sharding: no axis used twice


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_rule_on_both_meshes(name, mesh_name):
    make_mesh, specs = MESHES[mesh_name]
    mesh = make_mesh()
    opt = jax.eval_shape(treeopt.Optimizer(TRANSFORMATIONS[name]()).init, make_params())
    base = optimizer_specs(opt, specs)
    zero = optimizer_specs(opt, specs, shard_state_over="data", mesh=mesh)
    assert check_zero_rule(opt, base, zero, ("data",), dict(mesh.shape)) > 0


def test_which_dimension_and_why_not():
    opt = jax.eval_shape(treeopt.Optimizer(optax.adam(1e-2)).init, make_params())
    report = zero_report(opt, SPECS_2D, mesh_2d(), "data")
    mu = {leaf.param: leaf for leaf in report.leaves if ".mu[" in leaf.path}
    assert (mu["embed"].dim, mu["embed"].zero_spec) == (0, P("data", "model"))
    assert (mu["dense/kernel"].dim, mu["dense/kernel"].zero_spec) == (0, P("data", "model"))
    assert mu["odd"].dim == 0  # (12, 10): 12 divides by 4, 10 does not
    # No free dimension takes "data": it joins "model" where their 8 shards divide the dimension.
    assert (mu["dense/bias"].dim, mu["dense/bias"].zero_spec) == (0, P(("model", "data")))  # (32,)
    assert mu["head/kernel"].zero_spec == P(("model", "data"))  # (32, 10) P("model", None): 10 by 4 does not
    assert mu["norm/scale"].reason == "not divisible"  # (6,)
    assert mu["gain"].reason == "too small"  # a scalar
    (count,) = [leaf for leaf in report.leaves if leaf.param is None]
    assert (count.path, count.reason, count.zero_spec) == ("opt_state[0].count", "not param-owned", P())

    text = str(report)
    assert "ZeRO over 'data' (4 shards)" in text
    assert "opt_state[0].mu['embed']" in text and "(dimension 0)" in text
    assert "opt_state[0].nu['gain']" in text and "too small" in text

    report = zero_report(opt, SPECS_1D, mesh_1d(), "data")
    mu = {leaf.param: leaf for leaf in report.leaves if ".mu[" in leaf.path}
    assert mu["dense/kernel"].dim == 1  # (16, 32): the largest dimension
    assert mu["head/kernel"].dim == 0  # (32, 10): 10 does not divide by 8
    assert mu["odd"].reason == "not divisible"  # (12, 10) by 8
    assert mu["norm/scale"].reason == "too small"  # (6,) < 8


def test_fsdp_params_do_not_get_the_axis_twice():
    mesh = mesh_2d()
    params = {"w": jnp.ones((16, 8)), "v": jnp.ones((8, 16))}
    specs = {"w": P("data", "model"), "v": P(None, ("model", "data"))}
    tx = optax.chain(optax.adam(1e-2), optax.adafactor(1e-2, min_dim_size_to_factor=2))
    opt = treeopt.Optimizer(tx).init(params)
    zero = optimizer_specs(opt, specs, shard_state_over="data", mesh=mesh)
    adam, factored = zero.opt_state[0][0], zero.opt_state[1][0]
    assert adam.mu["w"] == P("data", "model")
    assert adam.mu["v"] == P(None, ("model", "data"))
    # w (16, 8): v_col (16,) keeps "data" from the param; v_row (8,) on "model" takes "data" beside it.
    assert factored.v_col["w"] == P("data")
    assert factored.v_row["w"] == P(("model", "data"))
    report = zero_report(opt, specs, mesh)
    reasons = {leaf.path: leaf.reason for leaf in report.leaves}
    for name in ("w", "v"):
        for moment in ("mu", "nu"):
            assert reasons[f"opt_state[0][0].{moment}['{name}']"] == "already uses the axis"
    assert reasons["opt_state[1][0].v_col['w']"] == "already uses the axis"
    assert reasons["opt_state[1][0].v_row['w']"] is None
    for spec in jax.tree.leaves(zero):
        NamedSharding(mesh, spec)

    # A tuple of axes: only those the leaf does not use yet are added, together.
    zero = optimizer_specs(
        opt, {"w": P(None, "model"), "v": P()}, shard_state_over=("data", "model"), mesh=mesh
    )
    assert zero.opt_state[0][0].mu["w"] == P("data", "model")
    assert zero.opt_state[0][0].mu["v"] == P(None, ("data", "model"))  # 16 by 4 x 2
    # (12, 8): 12 divides by "data" (4) alone, but not by the tuple's 8; 8 does.
    opt = treeopt.Optimizer(optax.adam(1e-2)).init({"u": jnp.ones((12, 8))})
    zero = optimizer_specs(opt, {"u": P()}, shard_state_over=("data", "model"), mesh=mesh)
    assert zero.opt_state[0].mu["u"] == P(None, ("data", "model"))


def test_equal_dimensions_take_the_first():
    opt = treeopt.Optimizer(optax.adam(1e-2)).init(
        {"square": jnp.ones((16, 16)), "cube": jnp.ones((3, 8, 8))}
    )
    zero = optimizer_specs(opt, {"square": P(), "cube": P()}, shard_state_over="data", mesh=mesh_1d())
    assert zero.opt_state[0].mu["square"] == P("data")
    assert zero.opt_state[0].mu["cube"] == P(None, "data")


def per_element_counter():
    """A transformation that keeps an int32 counter shaped like each parameter."""

    def init(params):
        return {"hits": jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.int32), params)}

    def update(updates, state, params=None):
        return updates, {"hits": jax.tree.map(lambda h: h + 1, state["hits"])}

    return optax.GradientTransformation(init, update)


def test_integer_state_keeps_its_params_layout():
    tx = optax.chain(per_element_counter(), optax.adam(1e-2))
    opt = jax.eval_shape(treeopt.Optimizer(tx).init, make_params())
    zero = optimizer_specs(opt, SPECS_2D, shard_state_over="data", mesh=mesh_2d())
    assert zero.opt_state[0]["hits"]["embed"] == P(None, "model")  # as its param, no "data"
    assert zero.opt_state[1][0].mu["embed"] == P("data", "model")
    report = zero_report(opt, SPECS_2D, mesh_2d())
    assert {leaf.reason for leaf in report.leaves if "['hits']" in leaf.path} == {"not floating point"}


def history_buffer():
    """A transformation whose state is a (64,) float vector that belongs to no parameter."""
    return optax.GradientTransformation(
        lambda params: {"history": jnp.zeros(64)}, lambda u, s, p=None: (u, s)
    )


def test_scalars_counts_hyperparams_and_keys_stay_replicated():
    tx = optax.chain(
        optax.add_noise(0.01, 0.55, key=jax.random.key(0)),
        optax.inject_hyperparams(optax.adamw)(learning_rate=optax.linear_schedule(1e-2, 1e-3, 10)),
        history_buffer(),
    )
    opt = jax.eval_shape(treeopt.Optimizer(tx).init, make_params())
    zero = optimizer_specs(opt, SPECS_1D, shard_state_over="data", mesh=mesh_1d())
    names = set(opt.paths)
    flat = jax.tree_util.tree_flatten_with_path(opt.opt_state)[0]
    owned_split = 0
    for (path, leaf), spec in zip(flat, jax.tree.leaves(zero.opt_state), strict=True):
        if owner_of(path, names) is None or leaf.shape == ():
            assert spec == P(), jax.tree_util.keystr(path)
        else:
            owned_split += spec != P()
    assert owned_split == 8  # mu and nu of the four leaves that divide by 8
    assert zero.opt_state[0].rng_key == P()
    assert zero.opt_state[1].hyperparams["learning_rate"] == P()
    assert zero.opt_state[2]["history"] == P()  # divisible, but nobody's state: left whole
    report = zero_report(opt, SPECS_1D, mesh_1d())
    assert {leaf.reason for leaf in report.leaves if leaf.param is None} == {"not param-owned"}


def count_masked(tree):
    is_masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    return sum(map(is_masked, jax.tree.leaves(tree, is_leaf=is_masked)))


def test_masked_and_multi_transform_keep_their_structure():
    masked = lambda: optax.masked(optax.adam(1e-2), treeopt.mask("*kernel"))  # noqa: E731
    for name, make_tx in (("masked", masked), ("multi_transform", TRANSFORMATIONS["multi_transform"])):
        opt = treeopt.Optimizer(make_tx()).init(make_params())
        zero = optimizer_specs(opt, SPECS_1D, shard_state_over="data", mesh=mesh_1d())
        assert count_masked(zero.opt_state) == count_masked(opt.opt_state) > 0, name
        assert jax.tree.structure(zero) == jax.tree.structure(opt)


def test_default_keeps_todays_specs():
    mesh = mesh_2d()
    opt = treeopt.Optimizer(TRANSFORMATIONS["adafactor"]()).init(make_params())
    today = opt.partition_specs(SPECS_2D)
    assert jax.tree.leaves(optimizer_specs(opt, SPECS_2D)) == jax.tree.leaves(today)
    assert jax.tree.leaves(
        optimizer_specs(opt, SPECS_2D, shard_state_over=None, mesh=mesh)
    ) == jax.tree.leaves(today)
    shardings = optimizer_shardings(opt, SPECS_2D, mesh)
    assert [s.spec for s in jax.tree.leaves(shardings)] == jax.tree.leaves(today)


def test_the_method_gives_the_same_specs():
    mesh = mesh_2d()
    opt = treeopt.Optimizer(TRANSFORMATIONS["adafactor"]()).init(make_params())
    method = opt.partition_specs(SPECS_2D, shard_state_over="data", mesh=mesh)
    function = optimizer_specs(opt, SPECS_2D, shard_state_over="data", mesh=mesh)
    assert jax.tree.structure(method) == jax.tree.structure(function)
    assert jax.tree.leaves(method) == jax.tree.leaves(function)
    with pytest.raises(ValueError, match="needs the mesh"):
        opt.partition_specs(SPECS_2D, shard_state_over="data")


def test_errors():
    mesh = mesh_2d()
    opt = treeopt.Optimizer(optax.adam(1e-2)).init(make_params())
    with pytest.raises(ValueError, match=r"shard_state_over='data' needs the mesh \(mesh=...\)"):
        optimizer_specs(opt, SPECS_2D, shard_state_over="data")
    with pytest.raises(
        ValueError, match=r"shard_state_over='dta': \['dta'\] is not an axis.*\('data', 'model'\)"
    ):
        optimizer_shardings(opt, SPECS_2D, mesh, shard_state_over="dta")
    with pytest.raises(ValueError, match=r"\['batch'\] is not an axis"):
        init_sharded(
            treeopt.Optimizer(optax.adam(1e-2)),
            make_params(),
            mesh,
            SPECS_2D,
            shard_state_over=("data", "batch"),
        )
    with pytest.raises(TypeError, match="mesh axis name or a non-empty tuple"):
        zero_report(opt, SPECS_2D, mesh, ())
    with pytest.raises(ValueError, match="names an axis twice"):
        zero_report(opt, SPECS_2D, mesh, ("data", "data"))
    # A parameter's own spec naming an axis the mesh lacks: the parameter is named.
    bad = {**SPECS_2D, "dense": {"kernel": P(None, "mlp"), "bias": P("model")}}
    with pytest.raises(ValueError, match=r"parameter 'dense/kernel'.*\['mlp'\].*rules="):
        optimizer_specs(opt, bad, shard_state_over="data", mesh=mesh)
    # Logical names are translated by rules first, then the data axis is added.
    zero = optimizer_specs(opt, bad, rules=[("mlp", "model")], shard_state_over="data", mesh=mesh)
    assert zero.opt_state[0].mu["dense/kernel"] == P("data", "model")


# -- on the devices: bytes, numbers, the compiled step ------------------------------------


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_device0_holds_a_data_sized_fraction_of_the_state(mesh_name):
    """Device 0's bytes of the state: (replicated layout - small leaves) / data size + small leaves."""
    make_mesh, specs = MESHES[mesh_name]
    mesh = make_mesh()
    n = mesh.shape["data"]
    params = jax.device_put(make_params(), named_shardings(specs, mesh))
    for name in ("adam", "adafactor"):
        tx = TRANSFORMATIONS[name]()
        base = init_sharded(treeopt.Optimizer(tx), params, mesh, specs)
        zero = init_sharded(treeopt.Optimizer(tx), params, mesh, specs, shard_state_over="data")
        report = zero_report(zero, specs, mesh, "data")
        if name == "adam":
            # mu and nu of: embed, dense/kernel, dense/bias, head/kernel (8 data shards, params replicated)
            # | embed, dense/kernel, odd, and dense/bias, head/kernel with "data" joining "model"
            assert len(report.sharded) == (8 if n == 8 else 10)
        # Leaf by leaf: a sharded leaf holds 1/n of its former shard on device 0.
        small = 0
        for b, z, leaf in zip(
            jax.tree.leaves(base.opt_state), jax.tree.leaves(zero.opt_state), report.leaves, strict=True
        ):
            if leaf.sharded:
                assert device0_bytes(z) * n == device0_bytes(b), leaf.path
            else:
                assert device0_bytes(z) == device0_bytes(b), leaf.path
                small += device0_bytes(b)
        before, after = device0_bytes(base.opt_state), device0_bytes(zero.opt_state)
        assert after == (before - small) / n + small, (name, before, after, small)
        assert after < before / (2 if name == "adam" else 1)
        assert report.bytes_per_device(zero=False) == before
        assert report.bytes_per_device() == after


def sharded_run(name, make_mesh, specs, over, x_all, y_all):
    """``STEPS`` data-parallel steps (batch split over "data"); the state ZeRO-sharded over ``over``."""
    mesh = make_mesh()
    param_sh = named_shardings(specs, mesh)
    batch_sh = NamedSharding(mesh, P("data"))
    params = jax.device_put(make_params(), param_sh)
    tx = TRANSFORMATIONS[name]()  # one tx object for the optimizer and its shardings
    opt = init_sharded(treeopt.Optimizer(tx), params, mesh, specs, shard_state_over=over)
    opt_sh = optimizer_shardings(opt, specs, mesh, shard_state_over=over)
    step = jax.jit(
        train_step,
        in_shardings=(param_sh, opt_sh, batch_sh, batch_sh),
        out_shardings=(param_sh, opt_sh),
        donate_argnums=(0, 1),
    )
    for x, y in zip(x_all, y_all, strict=True):
        params, opt = step(params, opt, x, y)
    assert int(opt.step) == STEPS
    for leaf, sharding in zip(jax.tree.leaves(opt), jax.tree.leaves(opt_sh), strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)  # still where out_shardings put it
    for leaf, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(param_sh), strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)  # the params gathered back
    return [np.asarray(leaf) for leaf in jax.tree.leaves((params, opt))], opt_sh


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
def test_twenty_steps_match_the_unsharded_run(name):
    x_all, y_all = zip(*(batch(i) for i in range(STEPS)), strict=True)
    # One device, plain jit.
    ref_params = make_params()
    ref_opt = treeopt.Optimizer(TRANSFORMATIONS[name]()).init(ref_params)
    ref_step = jax.jit(train_step)
    for x, y in zip(x_all, y_all, strict=True):
        ref_params, ref_opt = ref_step(ref_params, ref_opt, x, y)
    single = [np.asarray(leaf) for leaf in jax.tree.leaves((ref_params, ref_opt))]

    for make_mesh, specs in MESHES.values():
        zero, zero_sh = sharded_run(name, make_mesh, specs, "data", x_all, y_all)
        assert any("data" in axes_of(e) for s in jax.tree.leaves(zero_sh) for e in s.spec)
        # The same data-parallel steps with the state laid out like the params.
        unsharded, _ = sharded_run(name, make_mesh, specs, None, x_all, y_all)
        for got, want in zip(zero, unsharded, strict=True):
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
        # Both differ from one device only by the order the data-parallel mean adds up the batch.
        for got, want in zip(zero, single, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_compiled_step_arguments_and_outputs_shrink(mesh_name):
    make_mesh, specs = MESHES[mesh_name]
    mesh = make_mesh()
    param_sh = named_shardings(specs, mesh)
    batch_sh = NamedSharding(mesh, P("data"))
    tx = optax.adam(1e-2)
    abstract = jax.eval_shape(treeopt.Optimizer(tx).init, make_params())
    x, y = batch(0)
    stats = {}
    for over in (None, "data"):
        opt_sh = optimizer_shardings(abstract, specs, mesh, shard_state_over=over)
        compiled = (
            jax.jit(
                train_step,
                in_shardings=(param_sh, opt_sh, batch_sh, batch_sh),
                out_shardings=(param_sh, opt_sh),
                donate_argnums=(0, 1),
            )
            .lower(make_params(), abstract, x, y)
            .compile()
        )
        stats[over] = compiled.memory_analysis()
    report = zero_report(abstract, specs, mesh, "data")
    saved = report.bytes_per_device(zero=False) - report.bytes_per_device()
    assert saved > 0
    base, zero = stats[None], stats["data"]
    # Per device: the arguments and outputs lose exactly the state's saving.
    assert base.argument_size_in_bytes - zero.argument_size_in_bytes == saved
    assert base.output_size_in_bytes - zero.output_size_in_bytes == saved


def test_shardings_come_from_the_optimizers_own_tx():
    mesh = mesh_1d()
    params = make_params()
    opt = init_sharded(treeopt.Optimizer(optax.adam(1e-2)), params, mesh, SPECS_1D, shard_state_over="data")
    other = optimizer_shardings(  # an equal-looking but distinct optax.adam(1e-2)
        jax.eval_shape(treeopt.Optimizer(optax.adam(1e-2)).init, params),
        SPECS_1D,
        mesh,
        shard_state_over="data",
    )
    step = jax.jit(lambda p, o: (p, o), in_shardings=(None, other))
    with pytest.raises(ValueError, match="pytree"):
        step(params, opt)
    own = optimizer_shardings(opt, SPECS_1D, mesh, shard_state_over="data")
    jax.jit(lambda p, o: (p, o), in_shardings=(None, own))(params, opt)


# -- checkpoints ------------------------------------------------------------------------------


def test_checkpoint_restores_into_zero_replicated_and_smaller_meshes(tmp_path):
    mesh = mesh_2d()
    tx = TRANSFORMATIONS["adafactor"]()
    params = jax.device_put(make_params(), named_shardings(SPECS_2D, mesh))
    opt = init_sharded(treeopt.Optimizer(tx), params, mesh, SPECS_2D, shard_state_over="data")
    step = jax.jit(train_step, donate_argnums=(0, 1))
    for i in range(2):
        params, opt = step(params, opt, *batch(i))
    opt_sh = optimizer_shardings(opt, SPECS_2D, mesh, shard_state_over="data")
    opt = jax.device_put(opt, opt_sh)
    path = tmp_path / "ckpt"
    treeopt.checkpoint.save(path, opt)
    saved = [np.asarray(leaf) for leaf in jax.tree.leaves(opt)]
    target = jax.eval_shape(treeopt.Optimizer(tx).init, make_params())

    small = device_mesh((2, 2), ("data", "model"))
    layouts = {
        "ZeRO-sharded, same mesh": optimizer_shardings(target, SPECS_2D, mesh, shard_state_over="data"),
        "replicated": NamedSharding(mesh, P()),
        "ZeRO-sharded, 2x2 mesh": optimizer_shardings(target, SPECS_2D, small, shard_state_over="data"),
        "not ZeRO, 2x2 mesh": optimizer_shardings(target, SPECS_2D, small),
    }
    for label, shardings in layouts.items():
        restored = treeopt.checkpoint.restore(path, target, shardings=shardings)
        leaves = jax.tree.leaves(restored)
        want = (
            jax.tree.leaves(shardings)
            if not isinstance(shardings, NamedSharding)
            else [shardings] * len(leaves)
        )
        for leaf, sharding, value in zip(leaves, want, saved, strict=True):
            assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), label
            np.testing.assert_array_equal(np.asarray(leaf), value, err_msg=label)
    on_small = treeopt.checkpoint.restore(path, target, shardings=layouts["ZeRO-sharded, 2x2 mesh"])
    v_col = on_small.opt_state[0].v_col["embed"]  # (64,) split over data=2 of the 2x2 mesh
    assert v_col.sharding.spec == P("data") and {s.data.shape for s in v_col.addressable_shards} == {(32,)}
