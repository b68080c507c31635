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
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import treeopt

from _helpers import assert_trees_close

RTOL, ATOL = 1e-6, 1e-7
STEPS = 3

# Each entry builds a fresh transformation; the factory gets no arguments.
TRANSFORMATIONS = {
    "sgd": lambda: optax.sgd(0.1),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "adamax": lambda: optax.adamax(1e-2),
    "nadam": lambda: optax.nadam(1e-2),
    "nadamw": lambda: optax.nadamw(1e-2, weight_decay=0.1),
    "amsgrad": lambda: optax.amsgrad(1e-2),
    "adabelief": lambda: optax.adabelief(1e-2),
    "adagrad": lambda: optax.adagrad(1e-2),
    "adadelta": lambda: optax.adadelta(1.0),
    "rmsprop": lambda: optax.rmsprop(1e-2),
    "rmsprop_momentum": lambda: optax.rmsprop(1e-2, momentum=0.9, centered=True),
    "lamb": lambda: optax.lamb(1e-2),
    "lars": lambda: optax.lars(1e-2),
    "lion": lambda: optax.lion(1e-3),
    "yogi": lambda: optax.yogi(1e-2),
    "radam": lambda: optax.radam(1e-2),
    "novograd": lambda: optax.novograd(1e-2),
    "fromage": lambda: optax.fromage(1e-2),
    "sm3": lambda: optax.sm3(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=2),
    "noisy_sgd": lambda: optax.noisy_sgd(1e-2, key=jax.random.key(3)),
    "clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2)),
    "masked": lambda: optax.masked(optax.adam(1e-2), treeopt.mask("*a*")),
    "multi_transform": lambda: optax.multi_transform(
        {"fast": optax.adam(1e-2), "slow": optax.sgd(1e-3)},
        treeopt.labels({"*a*": "fast"}, default="slow"),
    ),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=2),
    "ademamix": lambda: optax.contrib.ademamix(1e-2),
    "schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(1e-2),
    "prodigy": lambda: optax.contrib.prodigy(1e-1),
    "dadapt_adamw": lambda: optax.contrib.dadapt_adamw(1e-1),
    "mechanize": lambda: optax.contrib.mechanize(optax.adam(1e-2)),
    "cocob": lambda: optax.contrib.cocob(),
    "madgrad": lambda: optax.contrib.madgrad(1e-2),
    "adamaxw": lambda: optax.adamaxw(1e-2),
    "adan": lambda: optax.adan(1e-2),
    "optimistic_adam_v2": lambda: optax.optimistic_adam_v2(1e-2),
    "optimistic_gradient_descent": lambda: optax.optimistic_gradient_descent(1e-2),
    "rprop": lambda: optax.rprop(1e-2),
    "sign_sgd": lambda: optax.sign_sgd(1e-2),
    "signum": lambda: optax.signum(1e-2),
}

# optax optimizers that need arguments beyond the gradients, checked in test_extra_args.py,
# and those optax deprecates for another one checked here.
NEEDS_EXTRA_ARGS = {"lbfgs", "polyak_sgd"}
DEPRECATED_IN_OPTAX = {"optimistic_adam": "optimistic_adam_v2"}


def grads_at(params, i):
    """Deterministic, non-trivial gradients that depend on the params and the step."""
    return jax.tree.map(lambda p: jnp.cos(p * (i + 1.0)) + 0.1 * p, params)


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
