"""Low-bit optimizer state: ``treeopt.Optimizer(tx, state_bits=8 | 4 | {glob: bits})``.

The reference is the same optimizer with full-precision state on the same
batches: a small teacher-student regression with minibatch noise, whose
weight matrices are large enough (64 x 64 and more) to be quantized. The
final loss must stay within 1 % at 8 bits and 3 % at 4 bits. The rest checks
that low-bit state composes with everything the state already did: jit,
donation, eager steps, masters, masks, state dicts, checkpoints, sharding.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import treeopt
from treeopt._lowbit.codec import Format, QuantizedLeaf, is_quantized
from treeopt._step import traced
from treeopt.errors import StateDictError

from _helpers import assert_trees_equal, device_mesh
from _teacher_student import TeacherStudent, final_loss

D_IN, D_HIDDEN, D_OUT = 64, 128, 64
STEPS, BATCH = 400, 32


def make_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "hidden": {"kernel": jax.random.normal(k1, (D_IN, D_HIDDEN)) / 8, "bias": jnp.zeros(D_HIDDEN)},
        "out": {"kernel": jax.random.normal(k2, (D_HIDDEN, D_OUT)) / 8},
    }


TEACHER = jax.random.normal(jax.random.key(7), (D_IN, D_OUT)) / 8


def loss_fn(params, x):
    h = jnp.tanh(x @ params["hidden"]["kernel"] + params["hidden"]["bias"])
    return jnp.mean((h @ params["out"]["kernel"] - jnp.sin(x @ TEACHER)) ** 2)


TASK = TeacherStudent(loss_fn, make_params, d_in=D_IN, batch_size=BATCH, steps=STEPS)
batch, train_step, train = TASK.batch, TASK.step, TASK.train


TRANSFORMATIONS = {
    "adam": lambda: optax.adam(3e-3),
    "adamw": lambda: optax.adamw(3e-3, weight_decay=1e-2),
    "lion": lambda: optax.lion(3e-4),
    "sgd_momentum": lambda: optax.sgd(3e-2, momentum=0.9),
}


@functools.cache
def reference(name):
    return final_loss(train(treeopt.Optimizer(TRANSFORMATIONS[name]()).init(make_params()))[2])


# -- quality against full precision ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "bits", "within"),
    [
        ("adam", 8, 0.01),
        ("adamw", 8, 0.01),
        ("lion", 8, 0.01),
        ("sgd_momentum", 8, 0.01),
        ("adam", 4, 0.03),
        ("adamw", 4, 0.03),
    ],
)
def test_the_final_loss_stays_within_the_stated_ratio_of_full_precision(name, bits, within):
    opt = treeopt.Optimizer(TRANSFORMATIONS[name](), state_bits=bits).init(make_params())
    assert any(is_quantized(x) for x in jax.tree.leaves(opt.opt_state, is_leaf=is_quantized))
    low = final_loss(train(opt)[2])
    full = reference(name)
    assert abs(low / full - 1) <= within, (low, full)


def test_the_statistics_are_codes_that_read_as_the_float_state():
    params = make_params()
    full = treeopt.Optimizer(optax.adam(3e-3)).init(params)
    low = treeopt.Optimizer(optax.adam(3e-3), state_bits=8).init(params)
    _, full, _ = train(full, steps=5)
    _, low, _ = train(low, steps=5)
    mu = low.opt_state[0].mu["hidden/kernel"]
    assert isinstance(mu, QuantizedLeaf) and mu.codes.dtype == jnp.uint8 and mu.scales.dtype == jnp.float32
    assert (mu.shape, mu.dtype) == ((D_IN, D_HIDDEN), jnp.float32)
    # Re-encoded after each update: the codes follow the float moments, not their initial zeros.
    reference_mu = full.opt_state[0].mu["hidden/kernel"]
    assert float(jnp.max(jnp.abs(reference_mu))) > 0
    np.testing.assert_allclose(
        mu.dequantize(), reference_mu, atol=0.03 * float(jnp.max(jnp.abs(reference_mu)))
    )


def test_second_moments_never_read_as_zero_where_they_are_positive():
    params = make_params()
    _, opt, _ = train(treeopt.Optimizer(optax.adam(3e-3), state_bits=4).init(params), steps=3)
    nu = opt.opt_state[0].nu["hidden/kernel"]
    assert not nu.format.signed and opt.opt_state[0].mu["hidden/kernel"].format.signed  # the map without zero
    assert bool(jnp.all(nu.dequantize() > 0))


def test_small_leaves_and_state_whose_precision_is_the_algorithm_stay_full_precision():
    params = {"big": jnp.ones((64, 64)), "small": jnp.ones((64, 63)), "vector": jnp.ones(64)}
    opt = treeopt.Optimizer(optax.adam(1e-3), state_bits=8).init(params)
    mu = opt.opt_state[0].mu
    assert is_quantized(mu["big"]) and not is_quantized(mu["small"]) and not is_quantized(mu["vector"])

    steps = treeopt.Optimizer(optax.MultiSteps(optax.adam(1e-3), 2), state_bits=8).init(params)
    assert not is_quantized(steps.opt_state.acc_grads["big"])
    assert is_quantized(steps.opt_state.inner_opt_state[0].mu["big"])

    free = treeopt.Optimizer(optax.contrib.schedule_free_adamw(1e-3), state_bits=8).init(params)
    assert not is_quantized(free.opt_state.z["big"])
    assert is_quantized(free.opt_state.base_optimizer_state[0].nu["big"])


def test_bytes_per_parameter_measured_from_the_arrays():
    params = {"w": jnp.zeros((1024, 1024))}
    n = 1024 * 1024

    def state_bytes(bits):
        opt = treeopt.Optimizer(optax.adam(1e-3), state_bits=bits).init(params)
        return sum(x.nbytes for x in jax.tree.leaves(opt.opt_state)) / n

    assert state_bytes(None) == pytest.approx(8.0, abs=1e-3)
    assert state_bytes(8) <= 2.1
    assert state_bytes(4) <= 1.1


# -- state_bits by name, and bad input -------------------------------------------------------------


def test_a_mapping_decides_by_the_first_matching_glob():
    params = {
        "embed": jnp.ones((64, 64)),
        "dense": {"kernel": jnp.ones((64, 64))},
        "head": jnp.ones((64, 64)),
    }
    opt = treeopt.Optimizer(optax.adam(1e-3), state_bits={"embed": None, "dense/*": 4, "*": 8}).init(params)
    mu = opt.opt_state[0].mu
    assert not is_quantized(mu["embed"])
    assert mu["dense/kernel"].bits == 4 and mu["head"].bits == 8


@pytest.mark.parametrize("bad", [16, 2, True, "8", 8.0, {"*": 16}, {}, [8]])
def test_any_other_state_bits_is_an_error_naming_state_bits_and_the_choices(bad):
    with pytest.raises(ValueError, match=r"state_bits must be None, 8, 4, or a mapping"):
        treeopt.Optimizer(optax.adam(1e-3), state_bits=bad)


def test_a_glob_that_matches_no_parameter_is_an_error_naming_it():
    with pytest.raises(
        ValueError, match=r"state_bits: the glob\(s\) \['encoder/\*'\] match no trained parameter"
    ):
        treeopt.Optimizer(optax.adam(1e-3), state_bits={"encoder/*": 8}).init({"w": jnp.ones((64, 64))})


# -- jit, donation, hyperparameters, eager ---------------------------------------------------------


def test_one_trace_with_donation_and_learning_rate_changes_and_eager_equals_jitted():
    tx = optax.inject_hyperparams(optax.adamw)(learning_rate=3e-3)
    params = make_params()
    traces = []

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, opt, i):
        traces.append(None)
        grads = jax.grad(loss_fn)(params, batch(i))
        return opt.update(grads, params), opt

    opt = treeopt.Optimizer(tx, state_bits=8).init(params)
    eager = treeopt.Optimizer(tx, state_bits=8).init(params)
    eager_params = params
    for i in range(4):
        opt.learning_rate = 3e-3 / (i + 1)
        eager.learning_rate = 3e-3 / (i + 1)
        params, opt = step(params, opt, i)
        eager_params = eager.update(jax.grad(loss_fn)(eager_params, batch(i)), eager_params)
    assert len(traces) == 1
    np.testing.assert_allclose(
        jax.tree.leaves(eager_params)[0], jax.tree.leaves(params)[0], rtol=1e-5, atol=1e-6
    )


def test_whether_a_twin_is_evaluated_is_static_data_of_the_step_and_flipping_it_compiles_again(monkeypatch):
    # TWIN_EVALUATION is read while a step's inputs are gathered, into their static data: the eager
    # step's compiled program is keyed by it, so a flip is never served the other program.
    updates = []
    adam = optax.adam(1e-3)

    def update(grads, state, params=None):
        updates.append(None)  # once per evaluation of tx.update in a trace: twice with a twin
        return adam.update(grads, state, params)

    tx = optax.GradientTransformation(adam.init, update)
    params = {"w": jnp.ones((64, 64))}
    opt = treeopt.Optimizer(tx, state_bits=8).init(params)
    grads = {"w": jnp.full((64, 64), 0.5)}
    counts = []
    for twin in (False, False, True, True, False):
        monkeypatch.setattr(traced, "TWIN_EVALUATION", twin)
        opt.update(grads, apply_updates=False)
        counts.append(len(updates))
    assert counts == [1, 1, 3, 3, 3]  # traced once each way, a twin evaluating tx.update twice
    assert int(opt.step) == 5


def test_master_weights_with_low_bit_state():
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_params())
    opt = treeopt.Optimizer(optax.adamw(3e-3), master_dtype=jnp.float32, state_bits=8).init(params)
    assert opt.master["hidden/kernel"].dtype == jnp.float32
    assert is_quantized(opt.opt_state[0].mu["hidden/kernel"])
    new_params, opt, _ = train(opt, params=params, steps=3)
    assert new_params["hidden"]["kernel"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        new_params["hidden"]["kernel"], opt.master["hidden/kernel"].astype(jnp.bfloat16)
    )


def test_masks_and_multi_transform_by_name():
    params = make_params()
    masked = optax.masked(optax.adam(3e-3), treeopt.mask("*kernel"))
    opt = treeopt.Optimizer(masked, state_bits=8).init(params)
    assert is_quantized(opt.opt_state.inner_state[0].mu["out/kernel"])
    parts = optax.multi_transform(
        {"fast": optax.adam(3e-3), "slow": optax.sgd(1e-3, momentum=0.9)},
        treeopt.labels({"hidden/*": "fast"}, default="slow"),
    )
    opt = treeopt.Optimizer(parts, state_bits=4).init(params)
    assert is_quantized(opt.opt_state.inner_states["fast"].inner_state[0].mu["hidden/kernel"])
    assert is_quantized(opt.opt_state.inner_states["slow"].inner_state[0].trace["out/kernel"])
    _, opt, losses = train(opt, steps=5)
    assert np.isfinite(losses).all()


# -- state dicts, warm starts, checkpoints ---------------------------------------------------------


def test_state_dict_holds_codes_and_scales_and_resumes_bit_for_bit():
    params, opt, _ = train(treeopt.Optimizer(optax.adam(3e-3), state_bits=4).init(make_params()), steps=3)
    sd = opt.state_dict()
    entry = sd["opt_state"]["0"]["mu"]["hidden/kernel"]
    assert set(entry) == {"codes", "scales", "format"}
    assert Format.from_entry(entry["format"]) == opt.opt_state[0].mu["hidden/kernel"].format
    restored = treeopt.Optimizer(optax.adam(3e-3), state_bits=4).init(make_params()).load_state_dict(sd)
    assert_trees_equal(restored.state_dict(), sd)
    p1, o1, _ = train(opt, params=params, steps=3, start=3)
    p2, o2, _ = train(restored, params=params, steps=3, start=3)
    assert_trees_equal(p1, p2)
    assert_trees_equal(o1.state_dict(), o2.state_dict())


def test_full_precision_state_into_a_low_bit_optimizer_is_a_mismatch_naming_the_entries():
    full = treeopt.Optimizer(optax.adam(3e-3)).init(make_params())
    low = treeopt.Optimizer(optax.adam(3e-3), state_bits=8).init(make_params())
    with pytest.raises(StateDictError, match=r"opt_state/0/mu/hidden/kernel/codes") as caught:
        low.load_state_dict(full.state_dict())
    assert "opt_state/0/mu/hidden/kernel" in caught.value.report.unexpected


def test_warm_start_converts_between_full_and_low_bit_state_and_reports_it():
    params, full, _ = train(treeopt.Optimizer(optax.adam(3e-3)).init(make_params()), steps=3)
    low, report = treeopt.serialization.warm_start(
        treeopt.Optimizer(optax.adam(3e-3), state_bits=8).init(params), full
    )
    converted = {path for path, _, _ in report.converted}
    assert converted == {
        f"opt_state/0/{f}/{n}" for f in ("mu", "nu") for n in ("hidden/kernel", "out/kernel")
    }
    assert ("opt_state/0/mu/out/kernel", f"float32[{D_HIDDEN}, {D_OUT}]", "8-bit signed codes") in report.converted
    reference_mu = full.opt_state[0].mu["out/kernel"]
    np.testing.assert_allclose(
        low.opt_state[0].mu["out/kernel"].dequantize(),
        reference_mu,
        atol=0.01 * float(jnp.abs(reference_mu).max()),
    )
    back, report = treeopt.serialization.warm_start(treeopt.Optimizer(optax.adam(3e-3)).init(params), low)
    assert len(report.converted) == 4 and report.ok
    np.testing.assert_array_equal(
        back.opt_state[0].mu["out/kernel"], low.opt_state[0].mu["out/kernel"].dequantize()
    )


def test_checkpoints_and_the_manager_round_trip_low_bit_state(tmp_path):
    params, opt, _ = train(treeopt.Optimizer(optax.adam(3e-3), state_bits=8).init(make_params()), steps=2)
    abstract = jax.eval_shape(treeopt.Optimizer(optax.adam(3e-3), state_bits=8).init, make_params())
    treeopt.checkpoint.save(tmp_path / "one", opt)
    assert_trees_equal(treeopt.checkpoint.restore(tmp_path / "one", abstract).state_dict(), opt.state_dict())
    with treeopt.checkpoint.CheckpointManager(tmp_path / "run") as manager:
        manager.save(2, opt, params, force=True)
        manager.wait_until_finished()
        restored, _ = manager.restore(abstract, jax.eval_shape(lambda: params), step=2)
    assert_trees_equal(restored.state_dict(), opt.state_dict())


# -- sharding --------------------------------------------------------------------------------------


def _mesh():
    return device_mesh((8, 1), ("data", "model"))


def test_partition_specs_give_codes_the_params_spec_and_scales_the_axes_they_keep():
    params = {"w": jnp.ones((64, 512))}
    opt = treeopt.Optimizer(optax.adam(1e-3), state_bits=8).init(params)
    specs = opt.partition_specs({"w": P("data", "model")})
    assert specs.opt_state[0].mu["w"].codes == P("data", "model")
    assert specs.opt_state[0].mu["w"].scales == P("data")
    zero = opt.partition_specs({"w": P()}, shard_state_over="data", mesh=_mesh())
    assert zero.opt_state[0].nu["w"].codes == P("data") and zero.opt_state[0].nu["w"].scales == P("data")
    # The blocks' axis keeps its entry in the scales only where its mesh axes' sizes are known and cut
    # whole blocks: "model" of size 2 does, an axis the sizes do not give is dropped.
    q = opt.opt_state[0].mu["w"]
    assert q.partition_specs(P("data", "model"), {"data": 4, "model": 2}).scales == P("data", "model")
    assert q.partition_specs(P("data", "model"), {"data": 4}).scales == P("data")


@pytest.mark.parametrize("bits", [8, 4])
def test_zero_one_splits_codes_and_scales_eightfold_with_whole_blocks_and_the_same_numbers(bits):
    mesh = _mesh()
    # "row" has one row: at 8 bits only its row of 16 blocks can be split (2 whole blocks a device); at
    # 4 bits a byte pairs the row's two halves, so it stays whole on every device.
    params = {"w": make_params()["hidden"]["kernel"], "row": jnp.linspace(-1, 1, 4096).reshape(1, 4096)}
    specs = {"w": P(), "row": P()}
    tx = optax.adam(1e-2)
    plain = treeopt.Optimizer(tx, state_bits=bits).init(params)
    sharded = treeopt.partitioning.init_sharded(
        treeopt.Optimizer(tx, state_bits=bits), params, mesh, specs, shard_state_over="data"
    )

    @jax.jit
    def step(p, opt, grads):
        return opt.update(grads, p), opt

    p1 = p2 = params
    for i in range(3):
        # The same gradients for both, computed once, as after the data-parallel all-reduce.
        keys = jax.random.split(jax.random.key(i), 2)
        grads = {
            name: jax.random.normal(k, x.shape)
            for k, (name, x) in zip(keys, sorted(params.items()), strict=True)
        }
        p1, plain = step(p1, plain, grads)
        p2, sharded = step(p2, sharded, grads)
    split = ("w", "row") if bits == 8 else ("w",)
    for name in split:
        q = sharded.opt_state[0].nu[name]
        for array in (q.codes, q.scales):
            assert array.addressable_shards[0].data.nbytes * 8 == array.nbytes
        codes_dim = next(d for d, e in enumerate(q.codes.sharding.spec) if e is not None)
        scales_dim = next(d for d, e in enumerate(q.scales.sharding.spec) if e is not None)
        assert codes_dim == scales_dim  # split on the same axis of the param
        if codes_dim == q.format.axis:  # the blocks' own axis: every device holds whole blocks
            assert math.prod(q.codes.addressable_shards[0].data.shape[q.format.axis :]) % q.block == 0
    if bits == 4:
        q = sharded.opt_state[0].nu["row"]
        assert q.codes.addressable_shards[0].data.nbytes == q.codes.nbytes
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_array_equal(a, b)  # the same numbers: splitting changes no arithmetic


def test_an_nnx_module_and_an_equinox_module_train_with_low_bit_state():
    from flax import nnx

    model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
    opt = treeopt.Optimizer(optax.adam(1e-2), state_bits=8).init(model)
    x = batch(0)
    before = float(jnp.mean(model(x) ** 2))
    for _ in range(5):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        assert opt.update(grads, model) is model
    assert float(jnp.mean(model(x) ** 2)) < before
    assert is_quantized(opt.opt_state[0].mu["kernel"])

    eqx = pytest.importorskip("equinox")
    linear = eqx.nn.Linear(64, 64, key=jax.random.key(0))
    opt = treeopt.Optimizer(optax.adam(1e-2), state_bits=8).init(eqx.filter(linear, eqx.is_array))
    grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(linear)
    new = opt.update(grads, linear)
    assert isinstance(new, eqx.nn.Linear) and is_quantized(opt.opt_state[0].mu["weight"])
    assert not np.array_equal(new.weight, linear.weight)


def test_named_shardings_of_the_specs_place_every_low_bit_leaf():
    mesh = _mesh()
    opt = treeopt.Optimizer(optax.adam(1e-3), state_bits=8).init({"w": jnp.ones((64, 512))})
    shardings = treeopt.partitioning.optimizer_shardings(opt, {"w": P()}, mesh, shard_state_over="data")
    placed = jax.device_put(opt, shardings)
    for field in ("mu", "nu"):
        leaf, before = getattr(placed.opt_state[0], field)["w"], getattr(opt.opt_state[0], field)["w"]
        # Split over the 8 "data" devices by rows: each holds 8 rows of codes and their whole blocks' scales.
        assert leaf.codes.sharding == NamedSharding(mesh, P("data")), field
        assert leaf.scales.sharding == NamedSharding(mesh, P("data")), field
        assert {s.data.shape for s in leaf.codes.addressable_shards} == {(8, 512)}
        assert {s.data.shape for s in leaf.scales.addressable_shards} == {(8, 2)}
        assert leaf.format == before.format
        np.testing.assert_array_equal(np.asarray(leaf.codes), np.asarray(before.codes))
        np.testing.assert_array_equal(np.asarray(leaf.scales), np.asarray(before.scales))


def test_a_donated_eight_bit_step_overwrites_its_codes_instead_of_copying_them(monkeypatch):
    # On a CPU the codes are encoded after the new params (which read the old codes) are
    # written, so XLA reuses the donated code buffers: the step's scratch is the partial
    # block maxima (an eighth of each moment, in float32: a byte per element for two
    # moments), not a copy of a moment's codes on top.
    monkeypatch.setattr(traced, "TWIN_EVALUATION", True)  # as on a CPU, on any backend
    params = {"w": jnp.ones((512, 1024))}
    opt = treeopt.Optimizer(optax.adam(1e-3), state_bits=8).init(params)
    step = jax.jit(lambda p, o, g: (o.update(g, p), o), donate_argnums=(0, 1))
    scratch = step.lower(params, opt, params).compile().memory_analysis().temp_size_in_bytes
    codes = opt.opt_state[0].mu["w"].codes.nbytes
    assert scratch < 1.5 * codes, (scratch, codes)
