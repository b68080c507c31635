"""Properties of setting a hyperparameter: exact in its dtype, never truncated, never silent."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import treeopt

PARAMS = {"w": jnp.ones(3)}
INT32 = np.iinfo(np.int32)
CARRIERS = {
    "python": float,
    "numpy float64": np.float64,
    "numpy 0-d array": lambda x: np.asarray(x, np.float64),
    "jax float32": lambda x: jnp.asarray(x, jnp.float32),
}


def state_with(learning_rate, dtype=None):
    return optax.inject_hyperparams(optax.sgd, hyperparam_dtype=dtype)(learning_rate=learning_rate).init(PARAMS)


def learning_rate(state):
    return treeopt.get_hyperparams(state)["learning_rate"]


def is_finite(bits, dtype):
    """Whether the bit pattern ``bits`` of ``dtype`` is a finite number: its exponent is not all ones.

    Read from the bits, since a float operation on a signalling NaN (``np.isfinite`` of
    bfloat16 0x7f81 goes through float32) raises the "invalid" floating-point flag.
    """
    info = jnp.finfo(dtype)
    all_ones = (1 << info.nexp) - 1
    return ((bits >> info.nmant) & all_ones) != all_ones


@settings(max_examples=200, deadline=None)
@given(x=st.floats(width=32, allow_nan=False, allow_infinity=False), carrier=st.sampled_from(sorted(CARRIERS)))
def test_any_float32_round_trips_exactly_in_a_float32_hyperparameter(x, carrier):
    state = state_with(0.1)
    old = learning_rate(state)
    new = learning_rate(treeopt.set_hyperparams(state, {"learning_rate": CARRIERS[carrier](x)}))
    assert (new.dtype, new.shape, new.weak_type) == (old.dtype, old.shape, old.weak_type)
    assert np.asarray(new).tobytes() == np.float32(x).tobytes()  # exact, signed zeros included


@pytest.mark.filterwarnings("error::RuntimeWarning")  # no float operation on a signalling NaN
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@settings(max_examples=100, deadline=None)
@given(bits=st.integers(0, 2**16 - 1))
@example(bits=0x7F81)  # a signalling NaN of bfloat16 (a NaN of float16)
def test_any_value_of_a_narrow_float_hyperparameter_round_trips_exactly(dtype, bits):
    assume(is_finite(bits, dtype))
    x = np.array(bits, np.uint16).view(dtype)
    state = state_with(0.5, dtype)
    new = learning_rate(treeopt.set_hyperparams(state, {"learning_rate": float(x)}))
    assert new.dtype == dtype and new.shape == ()
    assert np.asarray(new).tobytes() == x.tobytes()


@settings(max_examples=200, deadline=None)
@given(x=st.floats(allow_nan=False, allow_infinity=False))
def test_a_float_hyperparameter_gets_the_nearest_value_or_a_range_error(x):
    state = state_with(0.1)
    with np.errstate(over="ignore"):
        nearest = np.float32(x)
    if not np.isfinite(nearest):
        with pytest.raises(ValueError, match=r"'learning_rate' \(float32\[\]\): expected a value in the float32 range"):
            treeopt.set_hyperparams(state, {"learning_rate": x})
        return
    new = learning_rate(treeopt.set_hyperparams(state, {"learning_rate": x}))
    assert np.asarray(new).tobytes() == nearest.tobytes()


@settings(max_examples=200, deadline=None)
@given(n=st.integers(INT32.min, INT32.max))
def test_an_integer_hyperparameter_keeps_any_integer_in_range_exactly(n):
    state = state_with(1)
    old = learning_rate(state)
    new = learning_rate(treeopt.set_hyperparams(state, {"learning_rate": n}))
    assert (new.dtype, new.shape, new.weak_type) == (old.dtype, old.shape, old.weak_type)
    assert int(new) == n


@settings(max_examples=100, deadline=None)
@given(n=st.one_of(st.integers(max_value=INT32.min - 1), st.integers(min_value=INT32.max + 1)))
def test_an_integer_hyperparameter_refuses_integers_out_of_its_range(n):
    with pytest.raises(ValueError, match=r"'learning_rate' \(int32\[\]\): expected a value in the int32 range"):
        treeopt.set_hyperparams(state_with(1), {"learning_rate": n})


@settings(max_examples=200, deadline=None)
@given(x=st.floats(width=32, allow_nan=False, allow_infinity=False), carrier=st.sampled_from(sorted(CARRIERS)))
def test_an_integer_hyperparameter_never_truncates_a_float(x, carrier):
    new = learning_rate(treeopt.set_hyperparams(state_with(1), {"learning_rate": CARRIERS[carrier](x)}))
    assert new.dtype == jnp.float32 and new.shape == ()
    assert np.asarray(new).tobytes() == np.float32(x).tobytes()


@settings(max_examples=50, deadline=None)
@given(
    x=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    carrier=st.sampled_from(sorted(CARRIERS)),
    old=st.sampled_from([0.1, 1]),
)
def test_nan_and_infinities_are_refused(x, carrier, old):
    state = state_with(old)
    with pytest.raises(ValueError, match=r"'learning_rate' .*expected a finite number"):
        treeopt.set_hyperparams(state, {"learning_rate": CARRIERS[carrier](x)})
