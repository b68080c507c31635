"""treeopt.t5x refuses bad input as the core does, with the core's errors.

- ``derive_logical_axes`` (optax wrappers, the legacy Adafactor,
  MultiOptimizer) refuses an unexpected entry and a spec longer than its
  param's rank, exactly as ``Optimizer.partition_specs`` does.
- ``apply_gradient`` with grads that miss a param, have an extra one or a
  transposed one raises the core's mismatch error naming them, the report
  ``Optimizer.update`` gives for the same grads.
- The legacy Adafactor refuses a learning rate (or another numeric hyper
  param) that is not a number with the message an optax optimizer gives.
"""

from __future__ import annotations

import flax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import treeopt
from treeopt.errors import TreeMismatchError
from treeopt.t5x import adafactor, optimizers

PARAMS = {"dense": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)}}
AXES = {"dense": {"kernel": P("embed", "mlp"), "bias": P("mlp")}}
EVERYTHING = flax.traverse_util.ModelParamTraversal(lambda path, _: True)

DEFS = {
    "optax": lambda: optimizers.adam(1e-3),
    "adafactor": lambda: adafactor.Adafactor(0.1, min_dim_size_to_factor=2),
    "multi": lambda: optimizers.MultiOptimizer([(EVERYTHING, optimizers.sgd(0.1))]),
}

BAD_AXES = {
    "unexpected": ({**AXES, "zz": P()}, TreeMismatchError),
    "longer than the rank": ({"dense": {"kernel": P("embed", "mlp", "x"), "bias": P("mlp")}}, ValueError),
    "unexpected and missing": ({"dense": {"kernel": P("embed", "mlp")}, "zz": P()}, TreeMismatchError),
}

BAD_GRADS = {
    "missing": {"dense": {"kernel": jnp.ones((4, 8))}},
    "unexpected": {"dense": {**PARAMS["dense"], "extra": jnp.ones(2)}},
    "transposed": {"dense": {"kernel": jnp.ones((8, 4)), "bias": jnp.zeros(8)}},
}


def core_error(call):
    with pytest.raises(ValueError) as info:
        call()
    return info.value


@pytest.mark.parametrize("case", sorted(BAD_AXES))
@pytest.mark.parametrize("kind", sorted(DEFS))
def test_derive_logical_axes_refuses_what_partition_specs_refuses(kind, case):
    axes, error = BAD_AXES[case]
    core = core_error(lambda: treeopt.Optimizer(optax.adam(1e-3)).init(PARAMS).partition_specs(axes))
    opt_def = DEFS[kind]()
    with pytest.raises(error) as info:
        opt_def.derive_logical_axes(opt_def.create(PARAMS), axes)
    assert type(info.value) is type(core)
    if isinstance(core, TreeMismatchError):
        assert info.value.report == core.report
        assert str(info.value).startswith("param_logical_axes do not match the optimizer target:")
    else:
        assert str(info.value) == str(
            core
        )  # "PartitionSpec longer than the parameter's rank: 'dense/kernel' ..."


# The state's axes derive_logical_axes gives for AXES: Adam's moments take their param's axes,
# Adafactor's factored v_row/v_col the kernel's axes without the one each averages over (the
# bias, too small to factor, keeps a whole v), and plain SGD under MultiOptimizer has no state.
GOOD_STATE_AXES = {
    "optax": (optax.ScaleByAdamState(count=None, mu=AXES, nu=AXES), optax.EmptyState()),
    "adafactor": {
        "dense": {
            "kernel": adafactor.AdafactorParamState(v_row=P("embed"), v_col=P("mlp"), v=None, m=None),
            "bias": adafactor.AdafactorParamState(v_row=None, v_col=None, v=P("mlp"), m=None),
        }
    },
    "multi": ((optax.EmptyState(), optax.EmptyState()),),
}


@pytest.mark.parametrize("kind", sorted(DEFS))
def test_derive_logical_axes_still_takes_good_axes(kind):
    opt_def = DEFS[kind]()
    axes = opt_def.derive_logical_axes(opt_def.create(PARAMS), AXES)
    assert axes.target == AXES
    assert axes.state.step is None
    assert axes.state.param_states == GOOD_STATE_AXES[kind]


@pytest.mark.parametrize("case", sorted(BAD_GRADS))
@pytest.mark.parametrize("kind", sorted(DEFS))
def test_apply_gradient_refuses_grads_that_do_not_match_with_the_cores_report(kind, case):
    grads = BAD_GRADS[case]
    core = core_error(lambda: treeopt.Optimizer(optax.sgd(0.1)).init(PARAMS).update(grads, PARAMS))
    opt = DEFS[kind]().create(PARAMS)
    with pytest.raises(TreeMismatchError) as info:
        opt.apply_gradient(grads, learning_rate=0.1)
    assert info.value.report == core.report
    assert str(info.value) == str(core)


def test_grads_in_other_containers_with_the_same_names_and_shapes_pass_the_check():
    # The legacy Adafactor matches grads to params by name, so a dict of grads for a FrozenDict works.
    opt = adafactor.Adafactor(0.1, min_dim_size_to_factor=2).create(flax.core.freeze(PARAMS))
    opt = opt.apply_gradient({"dense": {"kernel": jnp.ones((4, 8)), "bias": jnp.ones(8)}})
    assert int(opt.state.step) == 1 and np.all(np.asarray(opt.target["dense"]["bias"]) < 0)


@pytest.mark.parametrize(
    "name, value",
    [("learning_rate", "x"), ("learning_rate", float("nan")), ("learning_rate", True), ("decay_rate", "0.8")],
)
def test_legacy_adafactor_refuses_a_hyper_param_that_is_not_a_number_as_optax_does(name, value):
    grads = {"dense": {"kernel": jnp.ones((4, 8)), "bias": jnp.ones(8)}}
    with pytest.raises((TypeError, ValueError)) as optax_path:
        optimizers.adam(1e-3).create(PARAMS).apply_gradient(grads, learning_rate=value)
    with pytest.raises(type(optax_path.value)) as legacy:
        adafactor.Adafactor(0.1).create(PARAMS).apply_gradient(grads, **{name: value})
    assert str(legacy.value) == str(optax_path.value).replace("'learning_rate'", f"'{name}'")


def test_legacy_adafactor_still_asserts_a_missing_learning_rate_and_takes_arrays():
    grads = {"dense": {"kernel": jnp.ones((4, 8)), "bias": jnp.ones(8)}}
    with pytest.raises(AssertionError, match="no learning rate provided"):
        adafactor.Adafactor(None).create(PARAMS).apply_gradient(grads)
    opt = adafactor.Adafactor(None).create(PARAMS).apply_gradient(grads, learning_rate=jnp.float32(0.1))
    assert int(opt.state.step) == 1
