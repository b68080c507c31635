"""Narrow params without a float32 copy (``param_rounding=``): Kahan-compensated or stochastic rounding.

For every trainable floating leaf narrower than float32 (bfloat16, float16),
``tx`` runs on the param cast up to float32, so its state is float32 (or
low-bit with ``state_bits``), and the new value is written back into the
param's own dtype by one of two means:

- ``"kahan"``: a compensation buffer in the param's dtype, keyed by name,
  holds what rounding the last sum lost; the next update adds it back first,
  so small updates add up instead of rounding away (+2 bytes per parameter
  for bfloat16);
- ``"stochastic"``: the new value rounds up or down at random, with the
  probability of each neighbour in proportion to its nearness, so the
  rounding is unbiased on average; one PRNG key in the state, split every
  step, makes the draws deterministic given the state (+0 bytes per parameter).

Leaves of float32 or wider are stepped exactly as without the option.

Example:
    >>> import jax, jax.numpy as jnp
    >>> x = jnp.full(10_000, 1.0 + 2.0**-10, jnp.float32)   # a quarter of a bfloat16 step above 1
    >>> rounded = stochastic_round(x, jnp.bfloat16, jax.random.key(0))
    >>> rounded.dtype, sorted(set(rounded.astype(float).tolist()))
    (dtype(bfloat16), [1.0, 1.0078125])
    >>> round(float(rounded.astype(jnp.float32).mean()), 4)   # unbiased: the mean stays at x
    1.001
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from treeopt._step.step_io import FlatStep, StepInputs
from treeopt._step.step_rule import next_step

__all__ = ["CHOICES", "checked_param_rounding", "initial_rounding", "narrow", "rounding_step", "stochastic_round"]

CHOICES = (None, "kahan", "stochastic")
_F32 = jnp.dtype(jnp.float32)


def checked_param_rounding(param_rounding: Any, master_dtype: Any) -> str | None:
    """``param_rounding`` checked: one of :data:`CHOICES`, and never together with ``master_dtype``.

    Example:
        >>> checked_param_rounding("kahan", None)
        'kahan'
        >>> checked_param_rounding("nearest", None)
        Traceback (most recent call last):
        ...
        ValueError: param_rounding must be None, 'kahan' or 'stochastic', got 'nearest'.
    """
    if not (param_rounding is None or (isinstance(param_rounding, str) and param_rounding in CHOICES)):
        raise ValueError(f"param_rounding must be None, 'kahan' or 'stochastic', got {param_rounding!r}.")
    if param_rounding is not None and master_dtype is not None:
        raise ValueError(
            f"param_rounding={param_rounding!r} and master_dtype={np.dtype(master_dtype).name} are two ways "
            "to train narrow params: master_dtype keeps a wider copy of each, param_rounding keeps none. "
            "Pass one of them."
        )
    return param_rounding


def narrow(dtype: Any) -> bool:
    """Whether a leaf of ``dtype`` is stepped through rounding: a floating dtype narrower than float32.

    Example:
        >>> narrow(jnp.bfloat16), narrow(jnp.float32), narrow(jnp.int8)
        (True, False, False)
    """
    return bool(jnp.issubdtype(dtype, jnp.floating)) and jnp.finfo(dtype).bits < 32


def initial_rounding(flat: Mapping[str, Any], mode: str | None, seed: int = 0) -> dict[str, Any]:
    """The rounding state of fresh params: ``{"compensation": {name: zeros}}``, ``{"key": key}`` or ``{}``.

    Example:
        >>> state = initial_rounding({"w": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2)}, "kahan")
        >>> {name: c.dtype.name for name, c in state["compensation"].items()}
        {'w': 'bfloat16'}
    """
    if mode == "kahan":
        return {"compensation": {k: jnp.zeros_like(v) for k, v in flat.items() if narrow(v.dtype)}}
    if mode == "stochastic" and any(narrow(v.dtype) for v in flat.values()):
        return {"key": jax.random.key(seed)}
    return {}


def stochastic_round(x: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
    """``x`` (float32) rounded to ``dtype``: to each neighbour with a probability in proportion to its nearness.

    So the expected value of the result is ``x``, for every narrow float dtype
    (bfloat16, float16, the float8s). Values exactly representable stay as
    they are; infinities and NaN pass through (to NaN where ``dtype`` has no
    infinity). A bfloat16 is the top half of a float32: adding 16 random bits
    below it and dropping them rounds up with exactly that probability, one
    integer add. Other dtypes draw a uniform and step to the neighbour by the
    bits of the value. The random bits are a hash of each element's position
    and a seed drawn from ``key`` (JAX's own generator costs on a CPU several
    times the whole step): deterministic given the key.
    """
    seed = jax.random.bits(key, (), jnp.uint32)
    noise = _hashed_bits(seed, x.shape)
    if jnp.dtype(dtype) == jnp.bfloat16:
        word = jax.lax.bitcast_convert_type(x, jnp.uint32)
        kept = (word + (noise >> 16)) & np.uint32(0xFFFF0000)
        rounded = jax.lax.bitcast_convert_type(kept, _F32).astype(dtype)  # exact: the low half is zero
        return jnp.where(jnp.isfinite(x), rounded, x.astype(dtype))
    info = jnp.finfo(dtype)
    if not _has_inf(dtype):  # float8_e4m3fn and the like: no infinity to round beyond the largest value
        x = jnp.where(jnp.isfinite(x), jnp.clip(x, -float(info.max), float(info.max)), x)
    nearest = x.astype(dtype)
    near32 = nearest.astype(_F32)
    other = _neighbour(nearest, x > near32)
    other32 = other.astype(_F32)
    gap = other32 - near32
    # The chance of the other neighbour: how far x is from the nearest, over the gap between them.
    usable = (gap != 0) & jnp.isfinite(gap) & jnp.isfinite(x)
    chance = jnp.where(usable, (x - near32) / jnp.where(usable, gap, 1.0), 0.0)
    uniform = (noise >> 8).astype(_F32) * np.float32(2.0**-24)
    return jnp.where((uniform < chance) & (x != near32), other, nearest)


def _hashed_bits(seed: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """32 well-mixed bits for every element of ``shape``: a hash of its flat position and ``seed``."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride % 2**32)
        stride *= shape[axis]
    h = index * np.uint32(0x9E3779B9) + seed  # spread positions apart, then mix (lowbias32)
    h = h ^ (h >> 16)
    h = h * np.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * np.uint32(0x846CA68B)
    return h ^ (h >> 16)


def _has_inf(dtype: Any) -> bool:
    return bool(np.isinf(np.array(np.inf).astype(jnp.dtype(dtype))))


def _neighbour(nearest: jax.Array, up: jax.Array) -> jax.Array:
    """The next representable value above (``up``) or below ``nearest``, stepping through the dtype's bits."""
    width = jnp.dtype(nearest.dtype).itemsize * 8
    uint = {8: jnp.uint8, 16: jnp.uint16}[width]
    sint = {8: jnp.int32, 16: jnp.int32}[width]
    bits = jax.lax.bitcast_convert_type(nearest, uint).astype(sint)
    sign = 1 << (width - 1)
    # Bits to an integer that orders like the values (-0 and +0 both 0), one step, and back.
    ordered = jnp.where(bits >= sign, -(bits - sign), bits)
    ordered = ordered + jnp.where(up, 1, -1)
    back = jnp.where(ordered < 0, sign - ordered, ordered)
    return jax.lax.bitcast_convert_type(back.astype(uint), nearest.dtype)


def rounding_step(inputs: StepInputs, extra: Mapping[str, Any]) -> FlatStep:
    """The step of narrow params through rounding: ``tx`` on float32 values, the result rounded back.

    The output of a narrow leaf is its new value in its own dtype, or (the
    updates) that minus the param given, in float32. Other leaves are stepped
    as without the option.
    """
    flat_params, rounding = inputs.params, inputs.rounding
    if flat_params is None:
        raise ValueError(
            "param_rounding needs the current params to round into: call "
            "opt.update(grads, params, apply_updates=False)."
        )
    is_narrow = {k: narrow(p.dtype) for k, p in flat_params.items()}
    params32 = {k: p.astype(_F32) if is_narrow[k] else p for k, p in flat_params.items()}
    grads32 = {k: g.astype(_F32) if is_narrow[k] else g for k, g in inputs.grads.items()}
    updates, new_state = inputs.tx.update(grads32, inputs.opt_state, params32, **extra)
    new_rounding, new_params = _rounded(flat_params, params32, updates, rounding, is_narrow)
    out = {}
    for k, p in flat_params.items():
        if not is_narrow[k]:
            out[k] = optax.apply_updates(p, updates[k]) if inputs.apply_updates else updates[k]
        else:
            out[k] = new_params[k] if inputs.apply_updates else new_params[k].astype(_F32) - params32[k]
    return FlatStep(next_step(inputs.step), new_state, out, rounding=new_rounding)


def _rounded(
    params: Mapping[str, Any],
    params32: Mapping[str, Any],
    updates: Mapping[str, Any],
    rounding: Mapping[str, Any],
    is_narrow: Mapping[str, bool],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(new rounding state, {name: new narrow param})`` of the narrow leaves."""
    names = [k for k in params if is_narrow[k]]
    if "compensation" in rounding:
        compensation, new = dict(rounding["compensation"]), {}
        for k in names:
            total = updates[k] + compensation[k].astype(_F32)  # what this step adds, and what the last one lost
            new[k] = (params32[k] + total).astype(params[k].dtype)
            compensation[k] = (total - (new[k].astype(_F32) - params32[k])).astype(params[k].dtype)
        return {"compensation": compensation}, new
    key, draw = jax.random.split(rounding["key"])
    keys = jax.random.split(draw, max(len(names), 1))
    new = {
        k: stochastic_round(params32[k] + updates[k], params[k].dtype, keys[i]) for i, k in enumerate(names)
    }
    return {"key": key}, new
