"""``ema=``: the average of the params, by its definition, from the masters, in every structure and on a mesh.

The reference is the definition itself, ``ema <- decay * ema + (1 - decay) * new``,
computed in NumPy: in float32 for the rounding of one step, in float64 over
a run. What a bfloat16 average (the params' own dtype, as ``nnx.EMA`` keeps
it) misses is measured against the same float64 reference.
"""

from __future__ import annotations

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import treeopt
from treeopt.partitioning import init_sharded, optimizer_shardings, zero_report
from treeopt.serialization import StateDictError, warm_start

from _helpers import device_mesh


def _params(dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 3)
    return {
        "embed": jax.random.normal(keys[0], (16, 8), dtype),
        "dense": {"kernel": jax.random.normal(keys[1], (8, 8), dtype), "bias": jnp.zeros(8, dtype)},
        "head": jax.random.normal(keys[2], (8, 4), dtype),
    }


def _loss(params, x):
    h = jnp.tanh(params["embed"][x] @ params["dense"]["kernel"] + params["dense"]["bias"])
    return jnp.mean((h @ params["head"]).astype(jnp.float32) ** 2)


def _batches(n):
    return np.random.default_rng(0).integers(0, 16, (n, 32))


@jax.jit
def _train_step(params, opt, x):
    return opt.update(jax.grad(_loss)(params, x), params), opt


def _flat(tree):
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


# -- the definition --------------------------------------------------------------------------------


@pytest.mark.parametrize("decay", [0.9, optax.linear_schedule(0.5, 0.95, 4)], ids=["float", "schedule"])
def test_the_average_follows_its_definition_to_float32_rounding(decay):
    params = _params()
    opt = treeopt.Optimizer(optax.adam(1e-2), ema=decay).init(params)
    expected = {name: np.asarray(leaf, np.float32) for name, leaf in _flat(params).items()}
    for step, x in enumerate(_batches(6)):
        params, opt = _train_step(params, opt, x)
        d = np.float32(decay(step) if callable(decay) else decay)
        for name, new in _flat(params).items():
            expected[name] = d * expected[name] + (np.float32(1) - d) * np.asarray(new, np.float32)
        for name, average in opt.ema.items():
            np.testing.assert_allclose(average, expected[name], rtol=2e-6, atol=1e-7, err_msg=name)
    assert int(opt.step) == 6 and {a.dtype for a in opt.ema.values()} == {np.dtype(np.float32)}


def test_bf16_params_average_their_masters_where_a_bf16_average_rounds_the_moves_away():
    params = _params(jnp.bfloat16)
    decay = 0.999
    opt = treeopt.Optimizer(optax.adam(1e-3), master_dtype=jnp.float32, ema=decay).init(params)
    reference = {name: np.asarray(leaf, np.float64) for name, leaf in _flat(params).items()}
    narrow = dict(_flat(params))  # the average nnx.EMA keeps for bf16 params: in their dtype
    d64, d16 = np.float64(decay), jnp.bfloat16(decay)
    for x in np.resize(_batches(100), (600, 32)):
        params, opt = _train_step(params, opt, x)
        for name, master in opt.master.items():
            reference[name] = d64 * reference[name] + (1 - d64) * np.asarray(master, np.float64)
        new = _flat(params)
        narrow = {name: d16 * narrow[name] + (1 - d16) * new[name] for name in narrow}

    def error(averages):
        num = sum(np.sum((np.asarray(averages[n], np.float64) - reference[n]) ** 2) for n in reference)
        return float(np.sqrt(num / sum(np.sum(r**2) for r in reference.values())))

    ours, bf16 = error(opt.ema), error(narrow)
    assert ours <= 1e-5, ours
    assert bf16 >= 100 * ours and bf16 > 1e-3, (bf16, ours)


def test_the_average_moves_only_when_multisteps_applies_an_update():
    params = {"w": jnp.zeros(3)}
    opt = treeopt.Optimizer(optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2), ema=0.5).init(params)
    seen = []
    for _ in range(4):
        params = opt.update({"w": jnp.ones(3)}, params)
        seen.append((float(params["w"][0]), float(opt.ema["w"][0])))
    # The params move on calls 2 and 4; the average with them, once per update.
    assert seen == [(0.0, 0.0), (-1.0, -0.5), (-1.0, -0.5), (-2.0, -1.25)]


@pytest.mark.parametrize(
    "options",
    [{"param_rounding": "kahan"}, {"param_rounding": "stochastic"}, {"state_bits": 8}],
    ids=["kahan", "stochastic", "8-bit"],
)
def test_the_average_is_exact_float32_under_every_precision_and_never_quantized(options):
    params = _params(jnp.float32 if "state_bits" in options else jnp.bfloat16)
    params["embed"] = jnp.ones((128, 64), params["embed"].dtype)  # large enough for 8-bit state
    opt = treeopt.Optimizer(optax.adam(1e-3), ema=0.9, **options).init(params)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.5, p.dtype), params)
    new = opt.update(grads, params)
    for name, average in opt.ema.items():
        assert type(average) is type(jnp.zeros(1)) and average.dtype == jnp.float32, name
        exact = np.asarray(_flat(new)[name], np.float32)
        if "compensation" in (opt.rounding or {}):
            exact = exact + np.asarray(opt.rounding["compensation"][name], np.float32)
        expected = np.float32(0.9) * np.asarray(_flat(params)[name], np.float32) + np.float32(0.1) * exact
        np.testing.assert_allclose(average, expected, rtol=1e-6, err_msg=name)


def test_update_without_params_needs_them_unless_masters_hold_the_new_values():
    opt = treeopt.Optimizer(optax.sgd(1.0), ema=0.5).init({"w": jnp.zeros(2)})
    with pytest.raises(ValueError, match=r"ema= averages the new params.*\['w'\].*apply_updates=False"):
        opt.update({"w": jnp.ones(2)}, apply_updates=False)
    updates = opt.update({"w": jnp.ones(2)}, {"w": jnp.zeros(2)}, apply_updates=False)
    assert updates["w"].tolist() == [-1.0, -1.0] and opt.ema["w"].tolist() == [-0.5, -0.5]
    masters = treeopt.Optimizer(optax.sgd(1.0), master_dtype=jnp.float32, ema=0.5)
    masters = masters.init({"w": jnp.zeros(2, jnp.bfloat16)})
    masters.update({"w": jnp.ones(2, jnp.bfloat16)}, apply_updates=False)
    assert masters.ema["w"].tolist() == [-0.5, -0.5]


# -- selection by glob ------------------------------------------------------------------------------


def test_globs_select_the_averaged_params_the_first_match_deciding():
    params = _params()
    opt = treeopt.Optimizer(optax.sgd(0.1), ema={"embed": None, "dense/*": 0.5, "*": 0.9}).init(params)
    assert sorted(opt.ema) == ["dense/bias", "dense/kernel", "head"]
    grads = jax.tree.map(jnp.ones_like, params)
    new = opt.update(grads, params)
    np.testing.assert_allclose(
        opt.ema["dense/kernel"], 0.5 * params["dense"]["kernel"] + 0.5 * new["dense"]["kernel"], rtol=1e-6
    )
    np.testing.assert_allclose(opt.ema["head"], 0.9 * params["head"] + 0.1 * new["head"], rtol=1e-6)
    assert treeopt.Optimizer(optax.sgd(0.1)).init(params).ema == {}


@pytest.mark.parametrize(
    ("ema", "error"),
    [
        ({"encoder/*": 0.9}, r"ema: the glob\(s\) \['encoder/\*'\] match no trained parameter"),
        ({"*": 0.9, "head": None}, r"ema: the glob 'head' comes after '\*'"),
        (1.0, r"ema must be None, a decay in \[0, 1\)"),
        ({"*": "0.9"}, r"ema must be .* got the entries \{'\*': '0.9'\}"),
    ],
)
def test_bad_rules_are_refused_naming_what_was_expected(ema, error):
    with pytest.raises(ValueError, match=error):
        treeopt.Optimizer(optax.sgd(0.1), ema=ema).init(_params())


# -- ema_params: the params' structure and dtypes ------------------------------------------------------


class _Linen(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.Dense(4, param_dtype=jnp.bfloat16)(linen.Dense(8)(x))


def _structures():
    linen_params = _Linen().init(jax.random.key(0), jnp.ones((1, 3)))
    eqx_model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(1))
    nnx_model = nnx.Linear(3, 2, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    return {"dict": _params(jnp.bfloat16), "linen": linen_params, "equinox": eqx_model, "nnx": nnx_model}


@pytest.mark.parametrize("kind", ["dict", "linen", "equinox", "nnx"])
def test_ema_params_keep_the_params_structure_and_dtypes(kind):
    params = _structures()[kind]
    options = {} if kind == "equinox" else {"master_dtype": jnp.float32}  # equinox's MLP is float32
    opt = treeopt.Optimizer(optax.sgd(0.5), ema=0.5, **options).init(params)
    start = {name: np.asarray(x, np.float32) for name, x in opt.layout.split_params(params)[0].items()}
    if kind == "nnx":
        grads = nnx.grad(lambda m: m(jnp.ones((1, 3))).sum())(params)
    else:
        grads = jax.tree.map(lambda x: jnp.ones_like(x) if eqx.is_inexact_array(x) else None, params)
    new = opt.update(grads, params)
    evaluated = opt.ema_params(new)
    assert evaluated is not new and jax.tree.structure(evaluated) == jax.tree.structure(new)
    dtypes = lambda tree: [getattr(x, "dtype", None) for x in jax.tree.leaves(tree)]  # noqa: E731
    assert dtypes(evaluated) == dtypes(new)
    flat_new, flat_evaluated = opt.layout.split_params(new)[0], opt.layout.split_params(evaluated)[0]
    assert sorted(opt.ema) == sorted(flat_new)
    for name, average in opt.ema.items():
        exact = opt.master.get(name, flat_new[name])  # the master where the param has one
        np.testing.assert_allclose(
            average, 0.5 * start[name] + 0.5 * np.asarray(exact, np.float32), rtol=1e-6
        )
        np.testing.assert_array_equal(flat_evaluated[name], average.astype(flat_evaluated[name].dtype))
        assert not np.array_equal(np.asarray(flat_evaluated[name]), np.asarray(flat_new[name])), name


def test_the_nnx_drop_in_gives_the_averages_as_a_state_to_evaluate_with():
    model = nnx.Linear(3, 2, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    start = {name: np.asarray(v[...], np.float32) for name, v in nnx.state(model, nnx.Param).items()}

    def make():
        return treeopt.nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param, master_dtype=jnp.float32, ema=0.5)

    optimizer = make()
    optimizer.update(model, nnx.grad(lambda m: m(jnp.ones((1, 3))).sum())(model))
    averages = optimizer.ema_params(model)
    assert isinstance(averages, nnx.State) and sorted(averages) == ["bias", "kernel"]
    masters = optimizer.treeopt.get_value().master
    for name in ("bias", "kernel"):
        value = averages[name][...] if isinstance(averages[name], nnx.Variable) else averages[name]
        expected = jnp.asarray(0.5 * start[name] + 0.5 * np.asarray(masters[name]), jnp.bfloat16)
        assert value.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(value), np.asarray(expected))
    evaluated = nnx.clone(model)
    nnx.update(evaluated, averages)
    assert not np.array_equal(np.asarray(evaluated.bias[...]), np.asarray(model.bias[...]))
    assert "ema" in optimizer.state_dict()
    restored = make()
    restored.load_state_dict(optimizer.state_dict())
    for name in ("bias", "kernel"):
        np.testing.assert_array_equal(
            np.asarray(restored.ema_params(model)[name]), np.asarray(averages[name])
        )


# -- state dicts, loads and warm starts ----------------------------------------------------------------


def test_a_state_dict_round_trip_gives_the_same_averages_and_strict_loads_name_ema():
    params = _params(jnp.bfloat16)
    make = lambda **kw: treeopt.Optimizer(optax.adam(1e-2), master_dtype=jnp.float32, **kw)  # noqa: E731
    opt = make(ema=0.9).init(params)
    for x in _batches(3):
        params, opt = _train_step(params, opt, x)
    sd = opt.state_dict()
    assert sorted(sd["ema"]) == sorted(opt.ema)
    restored = make(ema=0.9).init(_params(jnp.bfloat16)).load_state_dict(sd)
    for name, average in opt.ema.items():
        np.testing.assert_array_equal(restored.ema[name], average)
    with pytest.raises(StateDictError, match=r"unexpected \(4\):\n  ema/dense/bias"):
        make().init(params).load_state_dict(sd)
    with pytest.raises(StateDictError, match=r"missing \(4\):\n  ema/dense/bias"):
        make(ema=0.9).init(params).load_state_dict(make().init(params).state_dict())


def test_a_warm_start_from_an_optimizer_without_an_average_starts_it_from_the_params():
    params = _params(jnp.bfloat16)
    plain = treeopt.Optimizer(optax.adam(1e-2), master_dtype=jnp.float32).init(params)
    trained, plain = _train_step(params, plain, _batches(1)[0])
    target = treeopt.Optimizer(optax.adam(1e-2), master_dtype=jnp.float32, ema=0.9).init(trained)
    started, report = warm_start(target, plain.state_dict())
    assert sorted(report.missing) == [f"ema/{name}" for name in sorted(target.ema)]
    for name, average in started.ema.items():
        np.testing.assert_array_equal(average, np.asarray(_flat(trained)[name], np.float32))
    assert int(started.step) == 1


# -- ZeRO-1 on 8 devices -------------------------------------------------------------------------------


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_zero_splits_the_average_in_eight_with_one_devices_numbers(axis_types):
    mesh = device_mesh((8,), ("data",), axis_types)
    params = _params(jnp.bfloat16)
    params["embed"] = jax.random.normal(jax.random.key(3), (64, 8), jnp.bfloat16)
    specs = jax.tree.map(lambda _: P(), params)
    sharded = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    make = lambda: treeopt.Optimizer(optax.adam(1e-2), master_dtype=jnp.float32, ema=0.9)  # noqa: E731
    opt = init_sharded(make(), sharded, mesh, specs, shard_state_over="data")
    shardings = optimizer_shardings(opt, specs, mesh, shard_state_over="data")
    report = zero_report(opt, specs, mesh, "data")
    split = {leaf.path for leaf in report.sharded if leaf.path.startswith("ema")}
    assert split == {"ema['embed']", "ema['dense/kernel']", "ema['dense/bias']", "ema['head']"}
    for name, average in opt.ema.items():
        shards = {tuple(s.data.shape) for s in average.addressable_shards}
        assert len(average.addressable_shards) == 8 and all(np.prod(s) * 8 == average.size for s in shards), (
            name
        )
    local = make().init(params)
    step = jax.jit(lambda p, o, x: _train_step(p, o, x), out_shardings=(None, shardings))
    with jax.set_mesh(mesh):
        for x in _batches(3):
            sharded, opt = step(sharded, opt, x)
    for x in _batches(3):
        params, local = _train_step(params, local, x)
    for name, average in opt.ema.items():
        assert {tuple(s.data.shape) for s in average.addressable_shards} != {average.shape}, name
        np.testing.assert_allclose(np.asarray(average), np.asarray(local.ema[name]), rtol=1e-6, err_msg=name)


def _collectives(hlo: str) -> dict[str, int]:
    ops = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
    return {op: len(re.findall(rf"= \S+ {op}(?:-start)?\(", hlo)) for op in ops}


@pytest.mark.parametrize(
    ("axis_types", "dtype", "options"),
    [("auto", jnp.bfloat16, {"master_dtype": jnp.float32}), ("explicit", jnp.float32, {})],
    ids=["auto-masters", "explicit"],
)
def test_the_average_of_owned_muon_matrices_needs_no_extra_collective(axis_types, dtype, options):
    mesh = device_mesh((4, 2), ("data", "model"), axis_types)
    params = {f"layer{i}": jnp.full((64, 64), 0.1, dtype) for i in range(3)}
    specs = {name: P(None, "model") for name in params}
    placed = jax.device_put(params, {name: NamedSharding(mesh, spec) for name, spec in specs.items()})
    found = {}
    for ema in (None, 0.99):
        base = treeopt.Optimizer(optax.contrib.muon(1e-2), ema=ema, **options)
        opt = init_sharded(base, placed, mesh, specs, shard_state_over="data")
        shardings = optimizer_shardings(opt, specs, mesh, shard_state_over="data")

        def step(params, opt):
            return opt.update(jax.tree.map(jnp.ones_like, params), params), opt

        out = ({name: NamedSharding(mesh, spec) for name, spec in specs.items()}, shardings)
        with jax.set_mesh(mesh):
            found[ema] = _collectives(jax.jit(step, out_shardings=out).lower(placed, opt).compile().as_text())
    assert found[0.99] == found[None] and sum(found[None].values()) > 0, found


def test_a_checkpoint_of_the_split_average_restores_onto_another_mesh(tmp_path):
    mesh, small = device_mesh((8,), ("data",)), device_mesh((2,), ("data",))
    params = _params(jnp.bfloat16)
    specs = jax.tree.map(lambda _: P(), params)
    make = lambda: treeopt.Optimizer(optax.adam(1e-2), master_dtype=jnp.float32, ema=0.9)  # noqa: E731
    placed = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    opt = init_sharded(make(), placed, mesh, specs, shard_state_over="data")
    for x in _batches(2):
        placed, opt = _train_step(placed, opt, x)
    opt = jax.device_put(opt, optimizer_shardings(opt, specs, mesh, shard_state_over="data"))
    treeopt.checkpoint.save(tmp_path / "ckpt", opt)
    target = jax.eval_shape(make().init, params)
    shardings = optimizer_shardings(target, specs, small, shard_state_over="data")
    restored = treeopt.checkpoint.restore(tmp_path / "ckpt", target, shardings=shardings)
    for name, average in opt.ema.items():
        again = restored.ema[name]
        np.testing.assert_array_equal(np.asarray(again), np.asarray(average), err_msg=name)
        assert again.sharding.mesh.shape == {"data": 2}
        assert {s.data.shape for s in again.addressable_shards} == {(again.shape[0] // 2, *again.shape[1:])}
