"""Parity with raw optax: N jitted steps of treeopt.Optimizer == the same N steps of raw optax.

Both run the same transformation on the same nested pytree; treeopt's state is
over the flat, named view of it. Element-wise transformations give bit-identical
results; those that reduce across leaves (global norms) may differ by float
rounding of a sum, so the tolerance is rtol=1e-6, atol=1e-7.
"""

from __future__ import annotations

import functools
import string

import jax
import jax.numpy as jnp
import optax
import pytest
from _cases import TRANSFORMATIONS, grads_at
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import treeopt

from _helpers import assert_trees_close

RTOL, ATOL = 1e-6, 1e-7
STEPS = 3

# optax optimizers that need arguments beyond the gradients, checked in test_extra_args.py,
# and those optax deprecates for another one checked here.
NEEDS_EXTRA_ARGS = {"lbfgs", "polyak_sgd"}
DEPRECATED_IN_OPTAX = {"optimistic_adam": "optimistic_adam_v2"}


def run_raw(tx, params, steps=STEPS, **extra):
    if isinstance(tx, optax.MultiSteps):
        tx = tx.gradient_transformation()

    @jax.jit
    def step(params, state, i):
        updates, state = tx.update(grads_at(params, i), state, params, **extra)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    for i in range(steps):
        params, state = step(params, state, i)
    return params


def run_treeopt(tx, params, steps=STEPS, **extra):
    @jax.jit
    def step(params, opt, i):
        params = opt.update(grads_at(params, i), params, **extra)
        return params, opt

    opt = treeopt.Optimizer(tx).init(params)
    for i in range(steps):
        params, opt = step(params, opt, i)
    assert int(opt.step) == steps
    return params


def assert_same(actual, expected):
    assert_trees_close(actual, expected, same_dtypes=True, rtol=RTOL, atol=ATOL)


# Lower-case keys and lists shorter than 10: the flat names then sort in the same
# order as the nested leaves, which matters only for noisy_sgd's per-leaf keys.
keys = st.text(string.ascii_lowercase[:6], min_size=1, max_size=3)
shapes = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)
arrays = st.builds(
    lambda shape, seed: jax.random.normal(jax.random.key(seed), shape, jnp.float32),
    shapes,
    st.integers(0, 2**16),
)
pytrees = st.recursive(
    arrays,
    lambda children: st.one_of(
        st.dictionaries(keys, children, min_size=1, max_size=3),
        st.lists(children, min_size=1, max_size=3),
    ),
    max_leaves=6,
)


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=pytrees)
def test_matches_raw_optax(name, params):
    if name == "sm3":  # optax.sm3 itself does not support rank-0 params
        assume(all(leaf.ndim > 0 for leaf in jax.tree.leaves(params)))
    make = TRANSFORMATIONS[name]
    assert_same(run_treeopt(make(), params), run_raw(make(), params))


def optax_aliases() -> set[str]:
    """The names of optax's optimizer aliases: functions of its alias module, and partials of them.

    ``optax.nadam`` and ``optax.nadamw`` are ``functools.partial(adam, nesterov=True)`` (and of
    adamw): a partial's own ``__module__`` is ``functools``, so the function it wraps is what counts.
    """
    module = optax.adam.__module__
    found = set()
    for name in dir(optax):
        obj = getattr(optax, name)
        while isinstance(obj, functools.partial):
            obj = obj.func
        if callable(obj) and getattr(obj, "__module__", None) == module:
            found.add(name)
    return found


def test_alias_discovery_sees_partials():
    aliases = optax_aliases()
    assert {"adam", "sgd", "lion", "nadam", "nadamw"} <= aliases
    assert isinstance(optax.nadamw, functools.partial)  # why the unwrapping matters
    assert "chain" not in aliases and "scale_by_adam" not in aliases  # combinators and transforms live elsewhere


def test_every_optimizer_optax_ships_is_checked():
    aliases = optax_aliases()
    assert set(DEPRECATED_IN_OPTAX.values()) <= set(TRANSFORMATIONS)
    assert not aliases - set(TRANSFORMATIONS) - NEEDS_EXTRA_ARGS - set(DEPRECATED_IN_OPTAX)


def test_lookahead_matches_raw_optax():
    params = {"dense": {"kernel": jnp.arange(6.0).reshape(2, 3), "bias": jnp.ones(3)}}
    make = lambda: optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)  # noqa: E731

    tx = make()
    lp = optax.LookaheadParams.init_synced(params)
    state = tx.init(lp)
    for i in range(5):
        updates, state = tx.update(grads_at(lp.fast, i), state, lp)
        lp = optax.apply_updates(lp, updates)

    @jax.jit
    def step(lp, opt, i):
        return opt.update(grads_at(lp.fast, i), lp), opt

    mine = optax.LookaheadParams.init_synced(params)
    opt = treeopt.Optimizer(make()).init(mine)
    for i in range(5):
        mine, opt = step(mine, opt, i)
    assert isinstance(mine, optax.LookaheadParams)
    assert opt.paths == ("dense/bias", "dense/kernel")
    assert_same(mine, lp)


def test_extra_args_reach_the_transformation():
    params = {"w": jnp.linspace(-1.0, 1.0, 4)}
    make = lambda: optax.chain(  # noqa: E731
        optax.adam(1e-1), optax.contrib.reduce_on_plateau(patience=1, factor=0.5)
    )
    loss = jnp.float32(1.0)  # constant loss: the plateau scale must drop
    expected = run_raw(make(), params, steps=4, value=loss)
    assert_same(run_treeopt(make(), params, steps=4, value=loss), expected)


def test_float64_and_bfloat16_leaves_keep_their_dtype():
    params = {"a": jnp.ones((2, 2), jnp.bfloat16), "b": jnp.ones(3, jnp.float16)}
    assert_same(run_treeopt(optax.adam(1e-2), params), run_raw(optax.adam(1e-2), params))


def test_apply_updates_false_returns_the_raw_updates():
    params = {"x": jnp.arange(3.0), "y": [jnp.ones((2, 2))]}
    tx = optax.adam(1e-2)
    grads = grads_at(params, 0)
    expected, _ = tx.update(grads, tx.init(params), params)
    opt = treeopt.Optimizer(tx).init(params)
    assert_same(opt.update(grads, params, apply_updates=False), expected)
