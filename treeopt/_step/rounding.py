"""Rounding a float32 value into a narrow float dtype at random, without bias: :func:`stochastic_round`.

Each value rounds to one of its two neighbours in the narrow dtype, with the
probability of each in proportion to its nearness, so the rounding is right
on average: small updates add up over many steps instead of rounding away.
:class:`treeopt._step.precision.Stochastic` writes narrow params back with it.

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

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["is_float8", "saturated", "stochastic_round"]

_F32 = jnp.dtype(jnp.float32)


def is_float8(dtype: Any) -> bool:
    """Whether ``dtype`` is a float8 dtype (e4m3fn, e5m2, ...).

    Example:
        >>> import jax.numpy as jnp
        >>> is_float8(jnp.float8_e5m2), is_float8(jnp.bfloat16)
        (True, False)
    """
    return bool(jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 1)


def saturated(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` (wider) clipped to the finite range of ``dtype`` where that is a float8 dtype, else ``x``.

    A float8 cannot hold what the step adds past its largest value:
    float8_e4m3fn has no infinity and casts it to NaN, float8_e5m2 to an
    infinity no later step comes back from. So a float8 param saturates, as
    a cast with saturation does, and moves back as soon as its gradient turns.
    Wider dtypes keep IEEE overflow.

    Example:
        >>> import jax.numpy as jnp
        >>> saturated(jnp.array([470.0, -1e4, 3.0]), jnp.float8_e4m3fn).tolist()
        [448.0, -448.0, 3.0]
    """
    if not is_float8(dtype):
        return x
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(x, -top, top)


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
    # A float8 has no infinity to round to (e4m3fn) or none to come back from (e5m2): finite values saturate.
    x = jnp.where(jnp.isfinite(x), saturated(x, dtype), x)
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
