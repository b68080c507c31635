"""Adafactor's step, as T5X computes it: every parameter's update in one compiled program.

:func:`compiled_update` runs :func:`param_update` for each parameter, with
the per-parameter :class:`~treeopt.t5x._adafactor_rules.Plan` and the
hyper params that are Python constants as static data, so the program is
T5X's own jitted step; the learning rate (and any hyper param given as an
array) is an argument, so a new value never recompiles.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from treeopt import leaf_names
from treeopt.errors import TreeMismatchError
from treeopt.internal import checked_value
from treeopt.t5x._adafactor_rules import Plan

_FLOAT32 = np.float32(0.0)  # what a hyper param is checked as: a real float32 scalar


@struct.dataclass
class AdafactorParamState:
    """One parameter's Adafactor state; the slots it does not use hold ``zeros((1,))``.

    Example:
        >>> import flax, jax.numpy as jnp
        >>> s = AdafactorParamState(jnp.zeros(3), jnp.zeros(2), jnp.zeros(1), jnp.zeros(1))
        >>> sorted(flax.serialization.to_state_dict(s))
        ['m', 'v', 'v_col', 'v_row']
    """

    v_row: Any
    v_col: Any
    v: Any
    m: Any


SLOTS = ("v_row", "v_col", "v", "m")

# Numeric hyper params. learning_rate is always an argument of the compiled step (a new
# value never recompiles); the others are compile-time constants when they are Python
# or NumPy scalars (as in T5X's own jitted step) and arguments when they are arrays.
NUMERIC = (
    "beta1",
    "decay_rate",
    "step_offset",
    "clipping_threshold",
    "weight_decay_rate",
    "epsilon1",
    "epsilon2",
    "weight_decay_rate_lr_exponent",
    "global_norm_clip_threshold",
    "max_parameter_scale",
)


def decay_rate_pow(i: Any, exponent: float = 0.8) -> Any:
    """The second-moment decay at step ``i``: ``1 - (i + 1) ** -exponent``.

    Example:
        >>> float(decay_rate_pow(0)), round(float(decay_rate_pow(1)), 6)
        (0.0, 0.425651)
    """
    t = jnp.array(i, jnp.float32) + 1.0
    return 1.0 - t ** (-exponent)


class Flags(NamedTuple):
    """Truth tests T5X makes on hyper params (``if threshold:``), taken before compiling."""

    clip_global_norm: bool
    lr_exponent: bool
    skip_nan_updates: bool


class Config(NamedTuple):
    """The static part of a step: per-parameter plans, constant hyper params, flags, momentum dtype."""

    plans: tuple[Plan, ...]
    constants: tuple[tuple[str, str, Any], ...]  # (name, type name, value): 1 and 1.0 compile apart
    flags: Flags
    dtype_momentum: Any


def is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) or not _hashable(x)


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def truthy(x: Any) -> bool:
    """``bool(x)``, with a traced value counting as set."""
    if isinstance(x, jax.core.Tracer):
        return True
    return bool(x)


def flags_of(values: Mapping[str, Any], skip_nan_updates: Any) -> Flags:
    return Flags(
        truthy(values["global_norm_clip_threshold"]),
        truthy(values["weight_decay_rate_lr_exponent"]),
        bool(skip_nan_updates),
    )


def check_learning_rate(hyper_params: Any) -> None:
    """Refuses a missing learning rate as T5X does, and values that are not numbers as optax optimizers do.

    Each numeric hyper param that is set goes through the core's check of
    hyperparameter values (a string, a bool, NaN, an array of another shape:
    an error naming it, the message an optax optimizer gives); the values
    themselves are used as given.

    Example:
        >>> from treeopt.t5x.adafactor import Adafactor
        >>> try:
        ...     check_learning_rate(Adafactor(0.1).hyper_params.replace(learning_rate="x"))
        ... except TypeError as e:
        ...     print(e)
        Cannot set hyperparameter 'learning_rate' (float32[]): expected a real number, got the string 'x'.
    """
    if hyper_params.learning_rate is None:
        # T5X asserts; the same exception type, with the way out.
        raise AssertionError(
            "no learning rate provided: pass Adafactor(learning_rate=...) or "
            "optimizer.apply_gradient(grads, learning_rate=...)."
        )
    for name in ("learning_rate", *NUMERIC):
        value = getattr(hyper_params, name)
        if value is not None and not _finite_number(value):
            checked_value(name, _FLOAT32, value)  # raises, or accepts an array or another kind of number


def _finite_number(value: Any) -> bool:
    """A Python or NumPy real scalar that is finite: the common case, accepted without further checks."""
    return (
        isinstance(value, (int, float, np.integer, np.floating))
        and not isinstance(value, (bool, np.bool_))
        and math.isfinite(value)
    )


def is_param_state(x: Any) -> bool:
    return isinstance(x, AdafactorParamState)


def leaves_like(treedef: Any, names: list[str], tree: Any, is_leaf: Any) -> list[Any]:
    """``tree``'s entries at the params' positions; by name when its containers differ (dict vs FrozenDict)."""
    try:
        return treedef.flatten_up_to(tree)
    except (ValueError, TypeError):
        pass
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    by_name = dict(
        zip(leaf_names(jax.tree.map(lambda _: 0, tree, is_leaf=is_leaf)), (x for _, x in flat), strict=True)
    )
    missing = [n for n in names if n not in by_name]
    if missing:
        unexpected = sorted(set(by_name) - set(names))
        raise TreeMismatchError.between(
            "the tree does not match the params", missing=missing, unexpected=unexpected
        )
    return [by_name[n] for n in names]


def clip_global_norm(threshold: Any, grads: list[Any]) -> list[Any]:
    norm = jnp.sqrt(jnp.sum(jnp.array([jnp.sum(jnp.square(g)) for g in grads])))
    scale = threshold * jnp.minimum(1.0 / threshold, 1.0 / norm)
    return [g * scale for g in grads]


@functools.partial(jax.jit, static_argnums=0)
def compiled_update(
    config: Config,
    dynamic: dict[str, Any],
    step: Any,
    params: list[Any],
    states: list[Any],
    grads: list[Any],
) -> tuple[list[Any], list[Any], Any]:
    """All parameters' steps in one program: pure in everything but ``config``."""
    values = {**{name: value for name, _, value in config.constants}, **dynamic}
    if config.flags.clip_global_norm:
        grads = clip_global_norm(values["global_norm_clip_threshold"], grads)
    new_params, new_states = [], []
    for plan, param, state, grad in zip(config.plans, params, states, grads, strict=True):
        p, s = param_update(plan, values, config.flags, config.dtype_momentum, step, param, state, grad)
        new_params.append(p)
        new_states.append(s)
    return new_params, new_states, step + 1


def _weight_decay_rate(hp: Mapping[str, Any], flags: Flags) -> Any:
    """The decoupled weight decay; with ``weight_decay_rate_lr_exponent``, scaled by the learning rate."""
    rate = hp["weight_decay_rate"]
    if not flags.lr_exponent:
        return rate
    if isinstance(rate, jax.Array):
        rate = jnp.where(rate != 0, rate, 1.0)
    elif not rate:
        rate = 1.0
    return rate * hp["learning_rate"] ** hp["weight_decay_rate_lr_exponent"]


def _update_scale(plan: Plan, hp: Mapping[str, Any], param: Any) -> Any:
    """The learning rate, times the parameter's RMS (bounded by ``epsilon2``, ``max_parameter_scale``)."""
    if not plan.scale_by_param:
        return hp["learning_rate"]
    param_scale = jnp.sqrt(jnp.mean(param * param, axis=plan.averaging, keepdims=True))
    param_scale = jnp.maximum(param_scale, hp["epsilon2"])
    if hp["max_parameter_scale"] is not None:
        param_scale = jnp.minimum(param_scale, hp["max_parameter_scale"])
    return hp["learning_rate"] * param_scale


def _scaled_gradient(
    plan: Plan, hp: Mapping[str, Any], decay: Any, state: AdafactorParamState, grad: Any, new: dict[str, Any]
) -> Any:
    """The gradient over the root of the second moment (full or factored), which goes into ``new``."""
    mixing = 1.0 - decay
    grad_sqr = grad * grad + hp["epsilon1"]
    if plan.factored is None:
        new["v"] = decay * state.v + mixing * grad_sqr
        return grad * new["v"] ** -0.5
    d1, d0 = plan.factored
    new["v_row"] = decay * state.v_row + mixing * jnp.mean(grad_sqr, axis=d0)
    new["v_col"] = decay * state.v_col + mixing * jnp.mean(grad_sqr, axis=d1)
    # d1's positions among v_row's axes, once the d0 axes are gone.
    d1_in_row = tuple(d - sum(1 for e in d0 if e < d) for d in d1)
    row_mean = jnp.mean(new["v_row"], axis=d1_in_row, keepdims=True)
    row_factor = (new["v_row"] / row_mean) ** -0.5
    col_factor = new["v_col"] ** -0.5
    return grad * jnp.expand_dims(row_factor, axis=d0) * jnp.expand_dims(col_factor, axis=d1)


def param_update(
    plan: Plan,
    hp: Mapping[str, Any],
    flags: Flags,
    dtype_momentum: Any,
    step: Any,
    param: Any,
    state: AdafactorParamState,
    grad: Any,
) -> tuple[Any, AdafactorParamState]:
    """One parameter's step; ``hp`` maps hyper param names to constants or traced values."""
    grad = grad.astype(jnp.float32)
    new = {k: jnp.zeros((1,)) for k in SLOTS}
    decay = decay_rate_pow(step - hp["step_offset"], exponent=hp["decay_rate"])
    y = _scaled_gradient(plan, hp, decay, state, grad, new)
    if hp["clipping_threshold"] is not None:
        rms = jnp.sqrt(jnp.mean(y * y, axis=plan.averaging, keepdims=True))
        y = y / jnp.maximum(1.0, rms / hp["clipping_threshold"])

    subtrahend = _update_scale(plan, hp, param) * y
    beta1 = hp["beta1"]
    if beta1 is not None:
        subtrahend = beta1 * state.m + (1.0 - beta1) * subtrahend
        new["m"] = subtrahend.astype(dtype_momentum)

    weight_decay_rate = _weight_decay_rate(hp, flags)
    if weight_decay_rate is not None:
        new_param = (1.0 - weight_decay_rate) * param - subtrahend
    else:
        new_param = param - subtrahend

    if flags.skip_nan_updates:
        for k in SLOTS:
            new[k] = jnp.where(jnp.isnan(new[k]), getattr(state, k), new[k])
        new_param = jnp.where(jnp.isnan(new_param), param, new_param)
    return new_param.astype(param.dtype), AdafactorParamState(**new)
