"""treeopt.t5x loses nothing and hides nothing: checked restores, checksummed bytes, checked overrides.

- ``restore_state`` refuses what would load wrongly or silently (a value of
  another kind, ``None`` for the step, strings), naming each path.
- ``flax.serialization.from_bytes`` of an Optimizer either raises or loads the
  values that were saved: every single-bit flip of a small optimizer's bytes
  is tried.
- ``apply_gradient`` overrides: unknown names and bad values raise errors
  naming the hyperparameter; a new learning rate never recompiles.
"""

from __future__ import annotations

import math

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from treeopt.serialization import StateDictError
from treeopt.t5x import optimizers


def params():
    return {"dense": {"kernel": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "bias": jnp.zeros(3)}}


def grads_at(p, i):
    # Without the params term of the shared sequence: the raw-optax comparisons here hold at 1e-6.
    return jax.tree.map(lambda x: jnp.cos(x * (i + 1.0)), p)


# -- restore_state checks ------------------------------------------------------------------


def test_state_dict_error_is_the_core_s_and_a_value_error():
    assert issubclass(StateDictError, ValueError)


def test_an_integer_target_where_a_float_is_stored_is_refused():
    opt = optimizers.adamw(learning_rate=0.1).create(params())
    sd = opt.state_dict()
    sd["target"]["dense"]["kernel"] = np.zeros((2, 3), np.int32)
    with pytest.raises(
        StateDictError, match=r"target/dense/kernel: expected float32\[2, 3\] \(float\), got int32"
    ):
        opt.restore_state(sd)


def test_a_float_count_is_refused():
    opt = optimizers.adamw(learning_rate=0.1).create(params())
    sd = opt.state_dict()
    sd["state"]["param_states"]["0"]["count"] = np.float32(3.0)
    with pytest.raises(StateDictError, match=r"state/param_states/0/count: expected int32\[\] \(integer\)"):
        opt.restore_state(sd)


def test_a_step_of_none_is_refused():
    opt = optimizers.sgd(learning_rate=0.1).create(params())
    sd = opt.state_dict()
    sd["state"]["step"] = None
    with pytest.raises(StateDictError, match=r"state/step: expected .*\(integer\), got None"):
        opt.restore_state(sd)


@pytest.mark.parametrize("value", ["0.5", b"0.5", np.array(["a", "b", "c"])])
def test_strings_are_refused(value):
    opt = optimizers.sgd(learning_rate=0.1).create(params())
    sd = opt.state_dict()
    sd["target"]["dense"]["bias"] = value
    with pytest.raises(StateDictError, match=r"target/dense/bias: expected float32\[3\] \(float\), got"):
        opt.restore_state(sd)


def test_every_problem_is_listed_in_one_error():
    opt = optimizers.adamw(learning_rate=0.1).create(params())
    sd = opt.state_dict()
    sd["state"]["step"] = None
    sd["target"]["dense"]["bias"] = "x"
    del sd["state"]["param_states"]["0"]["mu"]["dense"]["kernel"]
    with pytest.raises(StateDictError) as err:
        opt.restore_state(sd)
    report = err.value.report
    assert report.missing == ("state/param_states/0/mu/dense/kernel",)
    assert [path for path, _, _ in report.mismatched] == ["state/step", "target/dense/bias"]
    assert "missing (1):\n  state/param_states/0/mu/dense/kernel" in str(err.value)


def test_same_kind_values_restore_as_given_like_t5x():
    # T5X's from_state_dict keeps the values it is given (a float64 numpy array from a
    # checkpoint reader, an int64 step): they restore, and training goes on.
    opt = optimizers.sgd(learning_rate=0.1, momentum=0.9).create(params())
    sd = jax.tree.map(
        lambda x: np.asarray(x, np.float64) if isinstance(x, jax.Array) else x, opt.state_dict()
    )
    sd["state"]["step"] = np.int64(7)
    restored = opt.restore_state(sd)
    assert int(restored.state.step) == 7
    restored = restored.apply_gradient(grads_at(params(), 0))
    assert restored.target["dense"]["kernel"].dtype == jnp.float32


def test_missing_target_or_state_is_refused():
    opt = optimizers.sgd(learning_rate=0.1).create(params())
    with pytest.raises(StateDictError, match=r"no \['state'\] entry"):
        opt.restore_state({"target": opt.state_dict()["target"]})


# -- flax bytes: every single-bit flip raises or loads the same values ---------------------------


def _same(a, b):
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x, y):
            return False
    return True


@pytest.mark.parametrize(
    "make",
    [lambda: optimizers.sgd(learning_rate=0.1, momentum=0.9), lambda: optimizers.adam(learning_rate=0.1)],
    ids=["sgd_momentum", "adam"],
)
def test_no_single_bit_flip_of_the_bytes_loads_other_values(make):
    opt_def = make()
    opt = opt_def.create({"w": jnp.arange(2.0)})
    opt = opt.apply_gradient({"w": jnp.ones(2)})
    data = flax.serialization.to_bytes(opt)
    template = opt_def.create({"w": jnp.zeros(2)})
    assert _same(flax.serialization.from_bytes(template, data), opt)

    silent, raised = [], 0
    for bit in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        try:
            restored = flax.serialization.from_bytes(template, bytes(flipped))
        except Exception:
            raised += 1
            continue
        if not _same(restored, opt):
            silent.append(bit)
    assert not silent, f"{len(silent)} of {len(data) * 8} single-bit flips loaded other values silently"
    assert raised > 0.9 * len(data) * 8


def test_bytes_with_a_wrong_checksum_name_the_corruption():
    opt = optimizers.sgd(learning_rate=0.1).create({"w": jnp.arange(2.0)})
    sd = flax.serialization.to_state_dict(opt)
    sd["target"]["w"] = np.array([0.0, 5.0], np.float32)
    with pytest.raises(StateDictError, match="checksum does not match"):
        flax.serialization.from_state_dict(opt, sd)


def test_bytes_written_without_a_checksum_load():
    # T5X's own Optimizer bytes carry no checksum: they still load.
    opt = optimizers.sgd(learning_rate=0.1).create({"w": jnp.arange(2.0)})
    data = flax.serialization.msgpack_serialize(jax.tree.map(np.asarray, opt.state_dict()))
    restored = flax.serialization.from_bytes(opt, data)
    assert _same(restored.target, jax.tree.map(np.asarray, opt.target))


# -- overrides --------------------------------------------------------------------------


def test_unknown_overrides_are_errors_naming_the_known_ones():
    opt = optimizers.adam(learning_rate=0.1).create(params())
    for name in ("b1", "weight_decay", "learning_rte"):
        with pytest.raises(TypeError, match=rf"\['{name}'\].*\['learning_rate'\]"):
            opt.apply_gradient(grads_at(params(), 0), **{name: 0.5})


def test_hyper_params_must_be_the_definition_s_own():
    opt = optimizers.adam(learning_rate=0.1).create(params())
    with pytest.raises(TypeError, match="hyper_params= of an optax optimizer"):
        opt.apply_gradient(grads_at(params(), 0), hyper_params={"learning_rate": 0.5})


@pytest.mark.parametrize(
    "value, error",
    [("0.1", TypeError), ([0.1], ValueError), (1j, TypeError), (np.complex64(1), TypeError),
     (True, TypeError), (np.ones(2), ValueError), (math.nan, ValueError), (np.float32("inf"), ValueError)],
)  # fmt: skip
def test_bad_learning_rates_are_refused_naming_the_hyperparameter(value, error):
    # Checked like a core hyperparameter (treeopt.hyperparams.checked_value), before any step runs.
    opt = optimizers.adam(learning_rate=0.1).create(params())
    with pytest.raises(error, match=r"hyperparameter 'learning_rate'.*expected"):
        opt.apply_gradient(grads_at(params(), 0), learning_rate=value)
    with pytest.raises(error, match="hyperparameter 'learning_rate'"):
        opt.optimizer_def.apply_gradient(
            optimizers._OptaxWrapperHyperParams(learning_rate=value),
            opt.target,
            opt.state,
            grads_at(params(), 0),
        )


def test_multi_optimizer_checks_overrides_per_sub_optimizer():
    everything = traverse_util.ModelParamTraversal(lambda path, _: True)
    opt = optimizers.MultiOptimizer([(everything, optimizers.sgd(0.1))]).create(params())
    with pytest.raises(TypeError, match=r"\['momentum'\]"):
        opt.apply_gradient(grads_at(params(), 0), momentum=0.5)
    with pytest.raises(TypeError, match="one entry per sub-optimizer"):
        opt.apply_gradient(grads_at(params(), 0), hyper_params={"learning_rate": 0.5})


def _counting_sgd():
    traces = []

    def counting_sgd(learning_rate, momentum=None):
        inner = optax.sgd(learning_rate, momentum)

        def update(updates, state, params=None):
            traces.append(None)  # runs while jax traces the step, not when it runs it
            return inner.update(updates, state, params)

        return optax.GradientTransformation(inner.init, update)

    return optimizers.wrap_optax_optimizer(counting_sgd), traces


def test_a_new_learning_rate_every_eager_step_does_not_retrace():
    counting_sgd, traces = _counting_sgd()
    opt = counting_sgd(learning_rate=1.0, momentum=0.9, honor_learning_rate=True).create(params())
    rates = [0.1, np.float32(0.05), jnp.float32(0.02), jnp.asarray(0.01), 0.005, 3]
    for i, lr in enumerate(rates):
        opt = opt.apply_gradient(grads_at(opt.target, i), learning_rate=lr)
    assert len(traces) == 1

    expected, state = params(), optax.sgd(1.0, 0.9).init(params())
    for i, lr in enumerate(rates):
        updates, state = optax.sgd(float(lr), 0.9).update(grads_at(expected, i), state)
        expected = optax.apply_updates(expected, updates)
    for a, e in zip(jax.tree.leaves(opt.target), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-6, atol=1e-7)


def test_steps_without_an_override_do_not_retrace_either():
    counting_sgd, traces = _counting_sgd()
    opt = counting_sgd(learning_rate=1.0).create(params())
    for i in range(3):
        opt = opt.apply_gradient(grads_at(opt.target, i))
    assert len(traces) == 1


def test_a_learning_rate_of_none_means_as_built():
    # T5X's trainer passes learning_rate=None when it has no schedule.
    opt = optimizers.sgd(learning_rate=0.5).create(params())
    stepped = opt.apply_gradient(grads_at(params(), 0), learning_rate=None)
    expected = jax.tree.map(lambda p, g: p - 0.5 * g, params(), grads_at(params(), 0))
    for a, e in zip(jax.tree.leaves(stepped.target), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-6)


def test_a_corrupted_checksum_name_does_not_switch_verification_off():
    # Bytes whose checksum entry lost its name would otherwise load unverified.
    opt = optimizers.sgd(learning_rate=0.1).create({"w": jnp.arange(2.0)})
    sd = jax.tree.map(np.asarray, flax.serialization.to_state_dict(opt))
    sd["chacksum"] = sd.pop("checksum")
    sd["target"]["w"] = np.array([0.0, 5.0], np.float32)
    with pytest.raises(StateDictError, match=r"unexpected top-level entries \['chacksum'\]"):
        flax.serialization.from_bytes(opt, flax.serialization.msgpack_serialize(sd))
