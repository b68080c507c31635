"""State dicts and flax.serialization of treeopt.Optimizer.

Every transformation of the core parity list (tests/core/test_parity.py) goes
through ``state_dict -> load_state_dict`` (also via numpy and msgpack) and
``flax.serialization.to_bytes -> from_bytes`` (also into an abstract target),
gives the identical state, and trains on bit-identically. State dicts from
another model or optimizer raise one error naming every path; corrupted bytes
never load.
"""

from __future__ import annotations

import functools
import warnings

import flax
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import (
    CASES,
    PARAMS,
    abstract,
    as_numpy,
    assert_same_state,
    assert_trains_identically,
    fresh,
    grads_of,
    initial_params,
    is_key,
    train,
    trained,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import treeopt
from treeopt import serialization as ser
from treeopt._state.plain import flatten_paths as flatten

from _helpers import device_mesh

# -- round trips, every transformation --------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_state_dict_round_trip(name):
    params, opt = trained(name)
    sd = opt.state_dict()
    for leaf in jax.tree.leaves(sd):
        assert isinstance(leaf, jax.Array) and not is_key(leaf)
    assert all(isinstance(k, str) for path in flatten(sd) for k in path)

    restored = fresh(name, opt).load_state_dict(sd)
    assert_same_state(restored, opt)
    assert_trains_identically(params, opt, restored)

    # through numpy and msgpack and back
    via_numpy = jax.tree.map(np.asarray, sd)
    data = flax.serialization.msgpack_serialize(via_numpy)
    restored = fresh(name, opt).load_state_dict(flax.serialization.msgpack_restore(data))
    assert_same_state(restored, opt)
    assert_trains_identically(params, opt, restored)


@pytest.mark.parametrize("name", sorted(CASES))
def test_flax_bytes_round_trip(name):
    params, opt = trained(name)
    data = flax.serialization.to_bytes(opt)
    restored = flax.serialization.from_bytes(fresh(name, opt), data)
    assert_same_state(restored, opt)
    assert_trains_identically(params, opt, restored)

    # into an abstract target from jax.eval_shape
    restored = flax.serialization.from_bytes(abstract(name, opt), data)
    assert_same_state(restored, opt)
    assert_trains_identically(params, opt, restored)


def test_flax_state_dict_round_trip_and_nesting():
    params, opt = trained("adamw")
    sd = flax.serialization.to_state_dict(opt)
    assert set(sd) == {"step", "opt_state", "checksum"}
    assert_same_state(flax.serialization.from_state_dict(fresh("adamw"), sd), opt)

    # inside another flax-serializable container
    container = {"opt": opt, "params": params}
    restored = flax.serialization.from_bytes(
        {"opt": fresh("adamw"), "params": PARAMS}, flax.serialization.to_bytes(container)
    )
    assert_same_state(restored["opt"], opt)


def test_typed_prng_key_is_stored_as_key_data():
    _, opt = trained("noisy_sgd")
    sd = opt.state_dict()
    rng = sd["opt_state"]["0"]["rng_key"]
    assert rng.dtype == jnp.uint32
    restored = fresh("noisy_sgd").load_state_dict(sd)
    key = restored.opt_state[0].rng_key
    assert is_key(key)
    np.testing.assert_array_equal(jax.random.key_data(key), rng)


# -- what a state dict looks like ----------------------------------------------------------


def test_state_dict_is_keyed_by_parameter_name():
    _, opt = trained("clip_adamw")
    sd = opt.state_dict()
    assert set(sd) == {"step", "opt_state"}
    assert set(sd["opt_state"]["1"]["0"]["mu"]) == {"dense/bias", "dense/kernel", "out/0"}
    assert sd["opt_state"]["0"] == {}  # clip_by_global_norm's EmptyState
    np.testing.assert_array_equal(
        sd["opt_state"]["1"]["0"]["mu"]["dense/kernel"], opt.opt_state[1][0].mu["dense/kernel"]
    )


def test_masked_nodes_are_empty_dicts_and_hold_nothing():
    _, opt = trained("masked")  # adam on the names matching "*a*"
    mu = opt.state_dict()["opt_state"]["inner_state"]["0"]["mu"]
    assert mu["out/0"] == {} and mu["dense/kernel"] == {} and mu["dense/bias"].shape == (4,)
    names = ["/".join(path) for path in flatten(opt.state_dict())]
    assert "opt_state/inner_state/0/mu/dense/bias" in names
    assert not any(n.startswith("opt_state/inner_state/0/mu/out") for n in names)


def test_state_dict_is_stable_when_leaves_reorder_or_a_layer_is_added():
    _, opt = trained("adam")
    sd = opt.state_dict()

    # Same names in another container: a FrozenDict and a different nesting order.
    frozen = flax.core.FrozenDict({"out": PARAMS["out"], "dense": PARAMS["dense"]})
    restored = treeopt.Optimizer(optax.adam(1e-2)).init(frozen).load_state_dict(sd)
    assert_same_state(restored, opt)

    # A new layer whose name sorts first shifts every leaf index, not the names.
    bigger = {"a_new": {"kernel": jnp.ones((2, 2))}, **PARAMS}
    target = treeopt.Optimizer(optax.adam(1e-2)).init(bigger)
    with pytest.warns(ser.StateDictWarning) as record:
        restored = target.load_state_dict(sd, strict=False)
    report = record[0].message.report
    assert report.missing == ("opt_state/0/mu/a_new/kernel", "opt_state/0/nu/a_new/kernel")
    assert report.unexpected == () and report.mismatched == ()
    new_sd = restored.state_dict()
    for field in ("mu", "nu"):
        for name in ("dense/kernel", "dense/bias", "out/0"):
            np.testing.assert_array_equal(
                new_sd["opt_state"]["0"][field][name], sd["opt_state"]["0"][field][name]
            )
        np.testing.assert_array_equal(new_sd["opt_state"]["0"][field]["a_new/kernel"], 0.0)
    assert int(restored.step) == int(opt.step)


# -- mismatches --------------------------------------------------------------------------------


def test_state_dict_of_another_model_names_every_path():
    _, opt = trained("adam")
    other = {
        "dense": {"kernel": jnp.ones((3, 5)), "bias": jnp.ones(4)},  # kernel reshaped
        "head": {"w": jnp.ones(2)},  # new; "out/0" is gone
    }
    target = treeopt.Optimizer(optax.adam(1e-2)).init(other)
    with pytest.raises(ser.StateDictError) as info:
        target.load_state_dict(opt.state_dict())
    message = str(info.value)
    for path in ("opt_state/0/mu/head/w", "opt_state/0/nu/head/w"):
        assert path in message.split("unexpected")[0]  # listed as missing
    for path in ("opt_state/0/mu/out/0", "opt_state/0/nu/out/0"):
        assert path in message.split("unexpected")[1]
    assert "opt_state/0/mu/dense/kernel: expected float32[3, 5], got float32[3, 4]" in message
    assert "opt_state/0/nu/dense/kernel: expected float32[3, 5], got float32[3, 4]" in message
    report = info.value.report
    assert len(report.missing) == 2 and len(report.unexpected) == 2 and len(report.mismatched) == 2


def test_state_dict_of_another_optimizer_names_every_path():
    _, opt = trained("sgd_momentum")
    with pytest.raises(ser.StateDictError) as info:
        fresh("adam").load_state_dict(opt.state_dict())
    message = str(info.value)
    assert "missing (7)" in message and "unexpected (3)" in message
    for path in ("opt_state/0/count", "opt_state/0/mu/dense/kernel", "opt_state/0/nu/out/0"):
        assert path in message
    assert "opt_state/0/trace/dense/bias" in message


def test_dtype_mismatch_is_reported():
    _, opt = trained("adam")
    sd = opt.state_dict()
    sd["opt_state"]["0"]["mu"]["dense/bias"] = sd["opt_state"]["0"]["mu"]["dense/bias"].astype(jnp.float16)
    with pytest.raises(ser.StateDictError, match=r"mu/dense/bias: expected float32\[4\], got float16\[4\]"):
        fresh("adam").load_state_dict(sd)


def test_strict_false_loads_what_matches_and_warns():
    _, opt = trained("adam")
    sd = opt.state_dict()
    del sd["opt_state"]["0"]["nu"]["dense/bias"]
    sd["opt_state"]["0"]["extra"] = jnp.ones(3)
    target = fresh("adam")
    with pytest.warns(ser.StateDictWarning, match="opt_state/0/nu/dense/bias") as record:
        restored = target.load_state_dict(sd, strict=False)
    report = record[0].message.report
    assert report.missing == ("opt_state/0/nu/dense/bias",)
    assert report.unexpected == ("opt_state/0/extra",)
    assert report == ser.check_state_dict(target, sd)
    got = restored.state_dict()["opt_state"]["0"]
    np.testing.assert_array_equal(got["mu"]["dense/bias"], sd["opt_state"]["0"]["mu"]["dense/bias"])
    np.testing.assert_array_equal(got["nu"]["dense/bias"], 0.0)  # kept the target's value
    assert int(restored.step) == 2


def test_strict_false_into_an_abstract_target_needs_every_leaf():
    _, opt = trained("adam")
    sd = opt.state_dict()
    del sd["step"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ser.StateDictWarning)
        with pytest.raises(ser.StateDictError, match=r"abstract.*\['step'\]"):
            abstract("adam").load_state_dict(sd, strict=False)


def test_load_state_dict_accepts_python_scalars():
    target = fresh("sgd")
    restored = target.load_state_dict({"step": 7, "opt_state": {"0": {}, "1": {}}})
    assert int(restored.step) == 7 and restored.step.dtype == jnp.int32


def test_load_state_dict_rejects_what_is_not_a_state_dict():
    with pytest.raises(TypeError, match="needs a state dict"):
        fresh("adam").load_state_dict([1, 2])  # type: ignore[arg-type]


def test_uninitialized_optimizer():
    opt = treeopt.Optimizer(optax.adam(1e-2))
    with pytest.raises(RuntimeError, match="not initialized"):
        opt.state_dict()
    assert flax.serialization.to_state_dict(opt) == {}
    assert flax.serialization.from_state_dict(opt, {}) is opt
    _, trained_opt = trained("adam")
    with pytest.raises(ser.StateDictError, match=r"not initialized.*eval_shape"):
        flax.serialization.from_bytes(opt, flax.serialization.to_bytes(trained_opt))


def test_state_dict_and_load_state_dict_under_jit():
    _, opt = trained("noisy_sgd")
    sd = jax.jit(lambda o: o.state_dict())(opt)
    restored = jax.jit(lambda o, s: o.load_state_dict(s))(fresh("noisy_sgd"), sd)
    assert_same_state(restored, opt)


def test_vmapped_batch_of_optimizers():
    params = {"w": jnp.ones((3, 2))}  # a batch of three 2-vectors
    init = jax.vmap(lambda p: treeopt.Optimizer(optax.adam(1e-2)).init({"w": p}))
    opts = init(params["w"])
    sd = opts.state_dict()
    assert sd["opt_state"]["0"]["mu"]["w"].shape == (3, 2)
    assert_same_state(init(params["w"]).load_state_dict(sd), opts)


# -- checksums and corrupted bytes -----------------------------------------------------------


def test_flax_state_dict_checksum_catches_edits_and_can_be_dropped():
    _, opt = trained("adam")
    sd = flax.serialization.to_state_dict(opt)
    sd["opt_state"]["0"]["mu"]["dense/bias"] = sd["opt_state"]["0"]["mu"]["dense/bias"] + 1
    with pytest.raises(ser.StateDictError, match="checksum does not match"):
        flax.serialization.from_state_dict(fresh("adam"), sd)
    del sd["checksum"]
    restored = flax.serialization.from_state_dict(fresh("adam"), sd)
    np.testing.assert_array_equal(
        restored.opt_state[0].mu["dense/bias"], opt.opt_state[0].mu["dense/bias"] + 1
    )


def test_truncated_bytes_raise():
    _, opt = trained("adafactor")
    data = flax.serialization.to_bytes(opt)
    for n in range(0, len(data), max(1, len(data) // 97)):
        with pytest.raises(treeopt.errors.CheckpointError, match="truncated or corrupted"):
            ser.from_bytes(fresh("adafactor"), data[:n])
        with pytest.raises(Exception):  # noqa: B017  - flax's own from_bytes raises msgpack's error
            flax.serialization.from_bytes(fresh("adafactor"), data[:n])


@pytest.mark.parametrize("name", ["adam", "noisy_sgd", "inject_hyperparams"])
def test_corrupted_bytes_never_load_silently(name):
    """Every single-byte corruption raises, or (where it does not touch the state) loads the same state."""
    _, opt = trained(name)
    data = flax.serialization.to_bytes(opt)
    target = fresh(name)
    expected = as_numpy(opt)
    raised = 0
    for i in range(len(data)):
        corrupted = bytearray(data)
        corrupted[i] ^= 0xFF if i % 2 else 0x01
        try:
            restored = ser.from_bytes(target, bytes(corrupted))
        except (treeopt.errors.CheckpointError, ser.StateDictError):
            raised += 1
            continue
        got = as_numpy(restored)
        assert got.keys() == expected.keys()
        for k in got:
            np.testing.assert_array_equal(got[k], expected[k], err_msg=f"byte {i}: {k}")
    assert raised > 0.9 * len(data)


def test_garbage_bytes_raise_a_clear_error():
    with pytest.raises(treeopt.errors.CheckpointError, match="not a state dict"):
        ser.from_bytes(fresh("adam"), flax.serialization.msgpack_serialize([1, 2]))
    with pytest.raises(treeopt.errors.CheckpointError, match="truncated or corrupted"):
        ser.from_bytes(fresh("adam"), b"\xc1garbage")


# -- warm start ----------------------------------------------------------------------------------


def test_warm_start_adam_to_adamw_keeps_mu_nu_and_count():
    params, adam = trained("adam", steps=3)
    adamw = treeopt.Optimizer(optax.adamw(1e-2, weight_decay=0.1)).init(params)
    adamw, report = ser.warm_start(adamw, adam)
    assert report.ok and not report.renamed
    assert_same_state(
        adamw, treeopt.Optimizer(optax.adamw(1e-2)).init(params).load_state_dict(adam.state_dict())
    )
    assert int(adamw.step) == 3
    # it trains as adamw from adam's moments
    p, _ = train(params, adamw, 1)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(p))


def test_warm_start_across_nesting_matches_field_and_parameter_name():
    params, adam = trained("adam", steps=3)
    target = treeopt.Optimizer(optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)).init(params)
    warm, report = ser.warm_start(target, adam.state_dict(), exclude="step")
    assert report.renamed["opt_state/inner_state/0/mu/dense/kernel"] == "opt_state/0/mu/dense/kernel"
    assert "step" in report.missing and int(warm.step) == 0
    np.testing.assert_array_equal(warm.opt_state.inner_state[0].nu["out/0"], adam.opt_state[0].nu["out/0"])
    assert float(warm.learning_rate) == pytest.approx(1e-3)  # hyperparameters stay the target's
    assert "loaded" in str(report)


def test_warm_start_between_unrelated_optimizers_loads_only_what_fits():
    params, sgd = trained("sgd_momentum")
    lion, report = ser.warm_start(treeopt.Optimizer(optax.lion(1e-3)).init(params), sgd)
    # lion's mu is not sgd's trace: nothing of the state carries over, only the step
    assert report.loaded == ("step",)
    assert "opt_state/0/trace/dense/kernel" in report.unexpected
    np.testing.assert_array_equal(lion.opt_state[0].mu["dense/kernel"], 0.0)


@pytest.mark.parametrize(
    "dtype", ["float32", "bfloat16", "float16", "int8", "int32", "uint32", "bool", "complex64", "int4"]
)
def test_checksum_is_the_same_on_host_and_on_device(dtype):
    from treeopt._state.checksum import _device_leaf_sums, _host_sums

    x = jnp.arange(-3, 9).reshape(3, 4).astype(dtype)
    assert _host_sums(np.asarray(x)) == _device_leaf_sums(x)
    for axis_type in ("explicit", "auto"):
        mesh = device_mesh((4,), ("x",), axis_type)
        sharded = jax.device_put(x.reshape(4, 3), NamedSharding(mesh, P("x")))
        assert _device_leaf_sums(sharded) == _host_sums(np.asarray(x).reshape(4, 3))


def test_warm_start_keeps_the_targets_hyperparameters_unless_asked():
    params = initial_params("adam")
    source = treeopt.Optimizer(optax.inject_hyperparams(optax.adam)(learning_rate=0.5)).init(params)
    params, source = train(params, source, 2)
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.01)
    warm, report = ser.warm_start(treeopt.Optimizer(tx).init(params), source)
    assert float(warm.learning_rate) == pytest.approx(0.01)
    assert "opt_state/hyperparams/learning_rate" in report.missing
    np.testing.assert_array_equal(
        warm.opt_state.inner_state[0].mu["out/0"], source.opt_state.inner_state[0].mu["out/0"]
    )
    warm, _ = ser.warm_start(treeopt.Optimizer(tx).init(params), source, hyperparams=True)
    assert float(warm.learning_rate) == pytest.approx(0.5)


# -- nothing lost, nothing silent ------------------------------------------------------------


@functools.partial(jax.jit, donate_argnums=1)
def donating_step(params, opt):
    return opt.update(grads_of(params, 0), params), opt


def _buffers(tree):
    return {
        shard.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree) for shard in x.addressable_shards
    }


def _shares_no_buffer(a, b):
    return not (_buffers(a) & _buffers(b))


def _alive_and_equal(opt, before):
    """``opt``'s leaves are not deleted and hold ``before`` (a numpy copy of its state dict)."""
    leaves = jax.tree.leaves(opt)
    assert not any(x.is_deleted() for x in leaves)
    now = as_numpy(opt)
    assert now.keys() == before.keys()
    for k in now:
        np.testing.assert_array_equal(now[k], before[k], err_msg="/".join(k))


def test_loaded_leaves_are_copies_so_donating_the_loaded_optimizer_keeps_the_source():
    params, source = train(PARAMS, treeopt.Optimizer(optax.adam(1e-2)).init(PARAMS), 2)
    before = as_numpy(source)
    targets = {
        "init": treeopt.Optimizer(source.tx).init(PARAMS),
        "committed": jax.device_put(treeopt.Optimizer(source.tx).init(PARAMS), jax.devices()[0]),
        "abstract": jax.eval_shape(treeopt.Optimizer(source.tx).init, PARAMS),
    }
    for name, target in targets.items():
        restored = target.load_state_dict(source.state_dict())
        assert _shares_no_buffer(restored, source), name
        donating_step(params, restored)
        _alive_and_equal(source, before)
    warm, _ = ser.warm_start(treeopt.Optimizer(optax.adamw(1e-2)).init(PARAMS), source.state_dict())
    assert _shares_no_buffer(warm, source)
    donating_step(params, warm)
    _alive_and_equal(source, before)


def test_loading_onto_sharded_leaves_copies_and_keeps_the_placement():
    mesh = device_mesh((4,), ("x",), "default")
    sharding = NamedSharding(mesh, P("x"))
    params = {"w": jax.device_put(jnp.arange(16.0).reshape(8, 2), sharding)}
    params, source = train(params, treeopt.Optimizer(optax.adam(1e-2)).init(params), 2)
    before = as_numpy(source)

    # Every leaf placed on the mesh: the loaded leaves are where the target's are.
    target = treeopt.Optimizer(source.tx).init(params)
    specs = target.partition_specs({"w": P("x")})
    target = jax.device_put(target, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    restored = target.load_state_dict(source.state_dict())
    assert _shares_no_buffer(restored, source)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
    assert restored.opt_state[0].mu["w"].sharding.is_equivalent_to(sharding, 2)
    donating_step(params, restored)
    _alive_and_equal(source, before)

    # A plain init (its counts uncommitted): the loaded optimizer still runs beside the mesh.
    plain = treeopt.Optimizer(source.tx).init(params)
    restored = plain.load_state_dict(source.state_dict())
    assert _shares_no_buffer(restored, source)
    assert restored.opt_state[0].mu["w"].sharding.is_equivalent_to(sharding, 2)
    donating_step(params, restored)
    _alive_and_equal(source, before)


def test_names_split_into_nested_dicts_are_reported_as_nested_not_missing_and_unexpected():
    params = {"a": {"b": jnp.ones(2)}, "c": jnp.ones(3)}
    opt = treeopt.Optimizer(optax.adam(1e-2)).init(params)
    # A '/'-separated flatten/unflatten splits the parameter name "a/b" into nested dicts.
    sd = flax.traverse_util.unflatten_dict(
        flax.traverse_util.flatten_dict(opt.state_dict(), sep="/"), sep="/"
    )
    assert sd["opt_state"]["0"]["mu"]["a"]["b"].shape == (2,)
    with pytest.raises(ser.StateDictError) as info:
        opt.load_state_dict(sd)
    report = info.value.report
    assert report.missing == () and report.unexpected == () and report.mismatched == ()
    assert report.misnested == (
        ("opt_state/0/mu/a/b", "sd['opt_state']['0']['mu']['a']['b']", "sd['opt_state']['0']['mu']['a/b']"),
        ("opt_state/0/nu/a/b", "sd['opt_state']['0']['nu']['a']['b']", "sd['opt_state']['0']['nu']['a/b']"),
    )
    message = str(info.value)
    assert "nested differently" in message and "split into nested dicts" in message
    assert (
        "found at sd['opt_state']['0']['mu']['a']['b'], expected at sd['opt_state']['0']['mu']['a/b']"
        in message
    )
    assert message.count("opt_state/0/mu/a/b") == 1
    assert "saved from another model" not in message
    assert ser.check_state_dict(opt, sd) == report
    with pytest.warns(ser.StateDictWarning, match="nested differently"):
        restored = opt.load_state_dict(sd, strict=False)
    assert int(restored.step) == int(opt.step)
    # warm_start says the same.
    _, warm_report = ser.warm_start(opt, sd)
    assert [m[0] for m in warm_report.misnested] == ["opt_state/0/mu/a/b", "opt_state/0/nu/a/b"]
    assert not any("a/b" in p for p in warm_report.missing + warm_report.unexpected)


def _sd_with_step(step):
    sd = fresh("sgd").state_dict()
    sd["step"] = step
    return sd


def test_a_step_out_of_the_int32_range_is_an_error_naming_step_and_the_range():
    with pytest.raises(ser.StateDictError) as info:
        fresh("sgd").load_state_dict(_sd_with_step(2**40))
    assert (
        "step: expected int32[], got int 1099511627776 (outside the int32 range [-2147483648, 2147483647])"
        in str(info.value)
    )
    assert info.value.report.mismatched[0][0] == "step"
    # Below the range, the step is negative first: the rule of every step says so.
    with pytest.raises(ser.StateDictError, match=r"step: expected a non-negative integer .*got -2147483649"):
        fresh("sgd").load_state_dict(_sd_with_step(-(2**31) - 1))
    assert int(fresh("sgd").load_state_dict(_sd_with_step(2**31 - 1)).step) == 2**31 - 1


@pytest.mark.parametrize(
    ("step", "got"),
    [
        (5.7, r"float 5.7 \(not an integer\)"),
        (-0.5, r"float -0.5 \(not an integer\)"),
        (float("nan"), r"float nan \(not an integer\)"),
        (float("inf"), r"float inf \(not an integer\)"),
        (True, r"bool True \(a bool\)"),
        (np.float32(5.0), r"float32 5.0"),
        (jnp.asarray(5.0), r"float32\[\]"),
    ],
    ids=repr,
)
def test_a_value_that_would_lose_part_of_itself_in_an_int_leaf_is_refused(step, got):
    with pytest.raises(ser.StateDictError, match=r"step: expected int32\[\], got " + got):
        fresh("sgd").load_state_dict(_sd_with_step(step))


def test_integral_python_floats_load_into_int_leaves():
    restored = fresh("sgd").load_state_dict(_sd_with_step(5.0))
    assert int(restored.step) == 5 and restored.step.dtype == jnp.int32


def test_python_scalars_out_of_a_float_leaf_s_range_or_of_another_kind_are_refused():
    tx = optax.apply_if_finite(optax.inject_hyperparams(optax.adam)(learning_rate=0.1), 3)
    opt = treeopt.Optimizer(tx).init(PARAMS)
    sd = opt.state_dict()
    hp = sd["opt_state"]["inner_state"]["hyperparams"]
    hp["learning_rate"] = 1e40
    with pytest.raises(
        ser.StateDictError,
        match=r"learning_rate: expected float32\[\], got float 1e\+40 \(outside the float32 range",
    ):
        opt.load_state_dict(sd)
    hp["learning_rate"] = 10**400
    with pytest.raises(
        ser.StateDictError, match=r"learning_rate: expected float32\[\], got int 1000.* \(outside the float32"
    ):
        opt.load_state_dict(sd)
    hp["learning_rate"] = 3  # an int into a float leaf: exact
    sd["opt_state"]["last_finite"] = False
    restored = opt.load_state_dict(sd)
    assert float(restored.learning_rate) == 3.0 and not bool(restored.opt_state.last_finite)
    sd["opt_state"]["last_finite"] = 1
    with pytest.raises(ser.StateDictError, match=r"last_finite: expected bool\[\], got int 1 \(not a bool\)"):
        opt.load_state_dict(sd)


def test_none_or_a_string_where_an_array_is_expected_names_the_path():
    sd = fresh("adam").state_dict()
    sd["step"] = None
    sd["opt_state"]["0"]["mu"]["dense/bias"] = "zeros"
    with pytest.raises(ser.StateDictError) as info:
        fresh("adam").load_state_dict(sd)
    message = str(info.value)
    assert "step: expected int32[], got None" in message
    assert "opt_state/0/mu/dense/bias: expected float32[4], got the string 'zeros'" in message
    assert info.value.report.missing == ()
    # None where the optimizer has no leaf is nothing, as in a state dict of optax None fields.
    sd = fresh("adam").state_dict()
    sd["opt_state"]["0"]["extra"] = None
    assert ser.check_state_dict(fresh("adam"), sd).ok


def test_an_abstract_target_cannot_keep_what_the_source_lacks(tmp_path):
    params = {"w": jnp.ones(3), "b": jnp.zeros(3)}
    opt = treeopt.Optimizer(optax.adam(0.1)).init(params)
    sd = opt.state_dict()
    del sd["opt_state"]["0"]["nu"]["b"]
    abstract = jax.eval_shape(opt.init, params)
    with (
        pytest.warns(ser.StateDictWarning),
        pytest.raises(ser.StateDictError, match=r"abstract.*opt_state/0/nu/b"),
    ):
        abstract.load_state_dict(sd, strict=False)
    # The same for params restored from a checkpoint that lacks one of them.
    treeopt.checkpoint.save(tmp_path / "c", opt, {"w": params["w"]})
    wanted = jax.eval_shape(lambda: params)
    with pytest.warns(ser.StateDictWarning), pytest.raises(ser.StateDictError, match=r"abstract.*\['b'\]"):
        treeopt.checkpoint.restore(tmp_path / "c", abstract, params=wanted, strict=False)
    # A concrete target keeps its own value where the source has none.
    with pytest.warns(ser.StateDictWarning, match="params paths"):
        _, restored = treeopt.checkpoint.restore(tmp_path / "c", opt, params=params, strict=False)
    np.testing.assert_array_equal(restored["b"], params["b"])
    np.testing.assert_array_equal(restored["w"], params["w"])


def test_key_helpers_convert_keys_only():
    from treeopt.keys import is_key, key_data, wrap_key_like

    key = jax.random.key(7)
    data = key_data(key)
    assert data.dtype == jnp.uint32 and not is_key(data)
    back = wrap_key_like(key, data)
    assert is_key(back) and jax.random.key_impl(back) == jax.random.key_impl(key)
    np.testing.assert_array_equal(jax.random.key_data(back), data)
    assert wrap_key_like(key, key) is key  # already a key
    plain = jnp.arange(2.0)
    assert wrap_key_like(plain, data) is data  # not a key slot: left as given
    assert key_data(plain) is plain
    abstract = jax.eval_shape(lambda: key)
    assert key_data(abstract).dtype == jnp.uint32 and isinstance(key_data(abstract), jax.ShapeDtypeStruct)


def test_load_state_dict_loads_in_place_and_returns_the_optimizer():
    params = {"dense": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}}
    trained = treeopt.Optimizer(optax.adam(1e-2)).init(params)
    for _ in range(3):
        params = trained.update(jax.tree.map(jnp.ones_like, params), params)
    sd = trained.state_dict()

    fresh = treeopt.Optimizer(optax.adam(1e-2)).init(params)
    returned = fresh.load_state_dict(sd)  # the torch habit: called for its effect
    assert returned is fresh and int(fresh.step) == 3
    np.testing.assert_array_equal(fresh.opt_state[0].mu["dense/kernel"], trained.opt_state[0].mu["dense/kernel"])

    # A strict load that does not fit changes nothing.
    other = treeopt.Optimizer(optax.adam(1e-2)).init(params)
    with pytest.raises(treeopt.serialization.StateDictError):
        other.load_state_dict({**sd, "opt_state": {}})
    assert int(other.step) == 0

    # flax's from_bytes returns the restored optimizer and leaves its target as it was.
    target = treeopt.Optimizer(optax.adam(1e-2)).init(params)
    restored = flax.serialization.from_bytes(target, flax.serialization.to_bytes(trained))
    assert int(restored.step) == 3 and int(target.step) == 0
