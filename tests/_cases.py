"""Cases shared across the test groups: the optax transformations every feature is checked on,
one gradient sequence, and trained optimizers to save and restore."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import treeopt
from treeopt._state.plain import flatten_paths as flatten

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



def grads_at(params, i):
    """Deterministic, non-trivial gradients that depend on the params and the step (non-floating leaves kept)."""
    return jax.tree.map(
        lambda p: jnp.cos(p * (i + 1.0)) + 0.1 * p if jnp.issubdtype(p.dtype, jnp.floating) else p, params
    )


# -- trained optimizers to save and restore: every transformation, plus those with extra inputs --

PARAMS = {
    "dense": {"kernel": jnp.arange(12.0).reshape(3, 4) / 10, "bias": jnp.linspace(-1.0, 1.0, 4)},
    "out": [jnp.ones((4, 2))],
}
CASES = {
    **TRANSFORMATIONS,
    "reduce_on_plateau": lambda: optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau()),
    "lookahead": lambda: optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5),
}


def initial_params(name):
    if name == "lookahead":
        return optax.LookaheadParams.init_synced(PARAMS)
    return PARAMS


def grads_of(params, i):
    return grads_at(params.fast if isinstance(params, optax.LookaheadParams) else params, i)


@jax.jit
def train_step(params, opt, i):
    extra = {"value": jnp.sum(jax.tree.leaves(params)[0])} if _needs_value(opt) else {}
    return opt.update(grads_of(params, i), params, **extra), opt


def _needs_value(opt):
    plateau = optax.contrib.ReduceLROnPlateauState
    found = jax.tree.leaves(opt.opt_state, is_leaf=lambda x: isinstance(x, plateau))
    return any(isinstance(x, plateau) for x in found)


def train(params, opt, steps, start=0):
    for i in range(start, start + steps):
        params, opt = train_step(params, opt, i)
    return params, opt


@functools.cache
def trained(name, steps=2):
    """``(params, opt)`` after ``steps`` steps; cached (one compile per transformation), so never mutate it.

    On device 0, as a restored checkpoint is: training it on after a restore runs the same
    compiled step, where uncommitted arrays would need one compile more per layout.
    """
    params = initial_params(name)
    opt = treeopt.Optimizer(CASES[name]()).init(params)
    params, opt = jax.device_put((params, opt), jax.devices()[0])
    return train(params, opt, steps)


def fresh(name, like=None):
    """A new optimizer for ``name``; with ``like``, over the same tx object (no recompilation)."""
    tx = like.tx if like is not None else CASES[name]()
    return treeopt.Optimizer(tx).init(initial_params(name))


def abstract(name, like=None):
    tx = like.tx if like is not None else CASES[name]()
    return jax.eval_shape(treeopt.Optimizer(tx).init, initial_params(name))


def as_numpy(opt):
    return {k: np.asarray(v) for k, v in flatten(opt.state_dict()).items()}


def assert_same_state(a, b):
    fa, fb = as_numpy(a), as_numpy(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        assert fa[k].dtype == fb[k].dtype and fa[k].shape == fb[k].shape, k
        np.testing.assert_array_equal(fa[k], fb[k], err_msg="/".join(k))
    assert [is_key(x) for x in jax.tree.leaves(a)] == [is_key(x) for x in jax.tree.leaves(b)]


def is_key(x):
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def assert_trains_identically(params, original, restored, steps=3):
    p1, o1 = train(params, original, steps, start=10)
    p2, o2 = train(params, restored, steps, start=10)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_same_state(o1, o2)


