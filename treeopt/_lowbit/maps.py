"""The maps of low-bit codes: which level in [-1, 1] each code stands for, and the code nearest a value.

A block of optimizer state is divided by its absolute maximum (its scale),
and each element takes the code of the nearest level of a fixed map. The
maps here are written as elementwise integer and float arithmetic, with no
table lookup: XLA fuses such arithmetic into the loops that read and write
the state (a table lookup is a gather, which XLA materializes), so a low-bit
step pays for the arithmetic of decoding and encoding, not for extra trips
through memory.

- **8-bit signed** (first moments, momentum traces): a sign bit and 7 bits of
  magnitude, a binary form of the dynamic map of Dettmers et al. ("8-bit
  Optimizers via Block-wise Quantization"), whose precision tapers with the
  magnitude: the top 2 octaves (down to 1/4 of the block maximum) have 32
  steps each, the next 2 have 16, then 8, 4, 2 and 1: 12 octaves, down to
  2.4e-4 of the maximum, then 0. The top level is exactly 1. On real Adam
  moments its error is two thirds of the decimal dynamic map's, and Lion,
  whose update is a sign, trains as with float32 state.
- **8-bit unsigned** (second moments, sums of squares): no zero level, so a
  small positive value never reads as 0 (the zero-point problem of Li et al.
  2023, "Memory Efficient Optimizers with 4-bit States"): codes 16..255 are a
  grid of 15 octaves, ``2**(e-16) * (1 + (f+1)/16)``, top exactly 1; codes
  0..15 are linear, ``(c+1) * 2**-19``, the smallest level 1.9e-6.
- **4-bit signed**: 16 levels ``f(k/8)`` for k = 1..8, 0, and ``-f(k/7)`` for
  k = 1..7, with ``f(x) = x * (47/64 - 29/64 x + 46/64 x**2)``; f(1) = 1, so
  both +1 and -1 are levels and no code is wasted. f is the cubic nearest the
  Lloyd-Max levels of block-normalized Adam first moments (docs/low-bit-state.md
  measures it against torchao's 4-bit map).
- **4-bit unsigned**: 16 evenly spaced levels 1/16 .. 1, no zero: the linear
  map without zero Li et al. chose for second moments (torchao does the same).

Every encoder returns the nearest level's code; where a value lies within
float32 rounding of the midpoint of two levels, either may be returned.

Example:
    >>> import jax.numpy as jnp
    >>> codes = encode(jnp.array([-1.0, -0.3, 0.0, 0.3, 1.0]), bits=8, signed=True)
    >>> decode(codes, bits=8, signed=True)
    Array([-1.      , -0.296875,  0.      ,  0.296875,  1.      ], dtype=float32)
    >>> decode(encode(jnp.array([0.0, 1e-7, 1.0]), bits=8, signed=False), bits=8, signed=False)
    Array([1.9073486e-06, 1.9073486e-06, 1.0000000e+00], dtype=float32)
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["decode", "encode", "levels", "looked_up", "smallest_level"]

# The float32 bit patterns under the octave grids: code ``m`` of the grid is the float whose bits are
# ``((m + 1) << 19) + base``, four mantissa bits a step, so the top code's pattern is exactly 1.0's.
_UNSIGNED8_BASE = (127 - 16) << 23
# The 8-bit signed map: segments of _OCTAVES octaves each, the top one with _TOP_BITS mantissa bits and
# each next one a bit fewer; magnitudes below the last segment are linear, down to exact 0.
_TOP_BITS, _OCTAVES, _SEGMENTS = 5, 2, 6
_LOWEST = 64 >> (_SEGMENTS - 1)  # the lowest tapered magnitude; those below are linear
assert _OCTAVES & (_OCTAVES - 1) == 0 and _LOWEST == 2  # the encoder's shift and two linear codes


def _linear_step() -> float:
    """The step of the signed map's linear magnitudes, up to its lowest tapered level without a gap."""
    first = 2.0 ** (-_OCTAVES * _SEGMENTS) * (1 + 2.0 ** (_SEGMENTS - 1 - _TOP_BITS))
    return first / _LOWEST
# The signed decoder's base pattern: segment s = clz(m) - 25 starts 2 s octaves below 1, at 64 >> s.
_SIGNED8_BASE = ((25 * _OCTAVES + 127 - _OCTAVES) << 23) - (64 << (23 - _TOP_BITS))
_LINEAR_STEP_BITS = int(np.float32(_linear_step()).view(np.int32))
_UNSIGNED8_LINEAR = 2.0**-19  # the step of codes 0..15 of the unsigned map
# f(x) = x * (A + x * (B + C * x)): the 4-bit signed magnitudes, exact binary fractions with A + B + C = 1.
_CUBIC = (47 / 64, -29 / 64, 46 / 64)


def decode(codes: Any, bits: int, signed: bool) -> jax.Array:
    """The level (float32, in [-1, 1]) each code of ``codes`` stands for in the ``bits``-bit map.

    Example:
        >>> import jax.numpy as jnp
        >>> decode(jnp.array([0, 7, 15], jnp.uint8), bits=4, signed=True)
        Array([-1.,  0.,  1.], dtype=float32)
    """
    c = jnp.asarray(codes).astype(jnp.int32)
    if bits == 8 and signed:
        m = c & 127
        # Magnitude m >= _LOWEST of segment s (clz(m) - 25) is (m + 1) << (18 + s), less (s << 24), above
        # a base: the segment's octaves and mantissa bits in one shift. Integer work alone, sign included.
        z = jax.lax.clz(jnp.maximum(m, _LOWEST))
        tapered = ((m + 1) << (z - 2 - _TOP_BITS)) - ((z * _OCTAVES) << 23) + _SIGNED8_BASE
        magnitude = jnp.where(m < _LOWEST, -m & _LINEAR_STEP_BITS, tapered)  # linear: 0 and 1 step
        return jax.lax.bitcast_convert_type(magnitude | ((c & 128) << 24), jnp.float32)
    if bits == 8:
        grid = _grid(c, _UNSIGNED8_BASE)
        return jnp.where(c < 16, (c + 1).astype(jnp.float32) * _UNSIGNED8_LINEAR, grid)
    if signed:
        k = jnp.asarray(codes).astype(jnp.float32) - 7  # in float: no integer copy for XLA to keep
        x = jnp.abs(k) * jnp.where(k > 0, np.float32(1 / 8), np.float32(1 / 7))
        a, b, cubic = _CUBIC
        magnitude = x * (a + x * (b + cubic * x))
        return jnp.where(k < 0, -magnitude, magnitude)
    return (jnp.asarray(codes).astype(jnp.float32) + 1) * np.float32(1 / 16)


def encode(y: Any, bits: int, signed: bool) -> jax.Array:
    """The code (int32) of the level nearest each element of ``y``, which lies in [-1, 1] ([0, 1] unsigned).

    Example:
        >>> import jax.numpy as jnp
        >>> encode(jnp.array([-1.0, 0.02, 1.0]), bits=4, signed=True)
        Array([ 0,  7, 15], dtype=int32)
    """
    y = jnp.asarray(y, jnp.float32)
    if bits == 8 and signed:
        z = jnp.abs(y)
        pattern = jax.lax.bitcast_convert_type(z, jnp.int32)
        # The segment from the octave: 0 for the top _OCTAVES octaves, below 1. A shift, not //, which
        # XLA would correct for negative numerators with three more operations per element.
        octave = 126 - (pattern >> 23)
        segment = jnp.clip(octave >> (_OCTAVES.bit_length() - 1), 0, _SEGMENTS - 1)  # arithmetic: int32
        shift = 23 - _TOP_BITS + segment
        base = (127 - _OCTAVES * (segment + 1)) << 23
        steps = (pattern - base + (1 << (shift - 1))) >> shift
        tapered = jnp.clip(steps - 1 + (64 >> segment), _LOWEST, 127)  # 0 steps: the segment below's top
        # The linear magnitudes below the tapered ones are 0 and 1 step: a comparison picks between them.
        step = _linear_step()
        m = jnp.where(z < (_LOWEST - 0.5) * step, (z >= 0.5 * step).astype(jnp.int32), tapered)
        return jnp.where((y < 0) & (m > 0), m + 128, m)  # no negative zero: one code for 0
    if bits == 8:
        # Below the midpoint of level 15 (2**-15) and level 16 (2**-15 * 17/16): the linear codes.
        linear = jnp.clip(_rounded(y * (1 / _UNSIGNED8_LINEAR)) - 1, 0, 15)
        return jnp.where(y < 2.0**-15 * (33 / 32), linear, jnp.clip(_grid_code(y, _UNSIGNED8_BASE), 16, 255))
    if signed:
        # The rank of |y| among the midpoints of its side (8 above 0, 7 below): a count of comparisons,
        # each against the midpoint of y's side, which XLA vectorizes as selects.
        positive, negative = _signed4_midpoints()
        negative_side = y < 0
        z = jnp.abs(y)
        rank = jnp.zeros(y.shape, jnp.int32)
        for i, above in enumerate(positive):
            below = np.float32(negative[i]) if i < len(negative) else np.float32(np.inf)
            rank = rank + (z > jnp.where(negative_side, below, np.float32(above))).astype(jnp.int32)
        return jnp.where(negative_side, 7 - rank, 7 + rank)
    return jnp.clip(_rounded(y * 16) - 1, 0, 15)


_MAGIC = np.float32(1.5 * 2**23)  # adding it leaves an integer's value in the low mantissa bits


def _rounded(v: jax.Array) -> jax.Array:
    """``round(v)`` (half to even) as int32 for ``|v| < 2**22``; any integer for larger, NaN or infinite ``v``.

    The float addition rounds, and the integer is read from the bits: no
    float-to-int conversion, which XLA makes saturating at several vector
    instructions an element.
    """
    return jax.lax.bitcast_convert_type(v.astype(jnp.float32) + _MAGIC, jnp.int32) - int(_MAGIC.view(np.int32))


def _grid(code: jax.Array, base: int) -> jax.Array:
    return jax.lax.bitcast_convert_type(((code + 1) << 19) + base, jnp.float32)


def _grid_code(z: jax.Array, base: int) -> jax.Array:
    """The grid code nearest ``z``: its bit pattern rounded to four mantissa bits (linear within an octave)."""
    bits = jax.lax.bitcast_convert_type(z, jnp.int32)
    return ((bits - base + (1 << 18)) >> 19) - 1


@functools.cache
def levels(bits: int, signed: bool) -> np.ndarray:
    """Every code's level, by code (read-only float32), as :func:`decode` computes it.

    Example:
        >>> levels(4, False)[:3], levels(8, True)[[0, 127, 128, 255]]
        (array([0.0625, 0.125 , 0.1875], dtype=float32), array([ 0.,  1., -0., -1.], dtype=float32))
    """
    with jax.ensure_compile_time_eval():  # concrete also while a step or an init is traced; one program
        table = np.asarray(jax.jit(decode, static_argnums=(1, 2))(jnp.arange(2**bits), bits, signed), np.float32)
    table.flags.writeable = False
    return table


def smallest_level(bits: int) -> float:
    """The smallest level of the unsigned ``bits``-bit map: a second moment never reads below it.

    Example:
        >>> smallest_level(8), smallest_level(4)
        (1.9073486328125e-06, 0.0625)
    """
    return float(levels(bits, False)[0])


@functools.cache
def _signed4_midpoints() -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The midpoints between consecutive 4-bit signed levels: above 0, and (as magnitudes) below it."""
    table = levels(4, True).astype(np.float64)
    above, below = table[7:], -table[7::-1]  # from 0 up to 1; from 0 down to -1, as magnitudes
    return _midpoints(above), _midpoints(below)


def _midpoints(side: np.ndarray) -> tuple[float, ...]:
    return tuple(float(np.float32((a + b) / 2)) for a, b in itertools.pairwise(side))


@contextlib.contextmanager
def looked_up(table: Any, bits: int = 4, signed: bool = True) -> Iterator[None]:
    """Within the block, codes of ``bits`` and ``signed`` are read and written by lookup in ``table``.

    ``table`` holds the ``2**bits`` levels, sorted; a value takes the code of
    the nearest. It is how another map is measured against this module's
    (``benchmarks/lowbit_maps.py``): the codec reads the maps through this
    module, and jitted functions are compiled again on the way in and out.

    Example:
        >>> import numpy as np
        >>> import treeopt._lowbit.maps as maps
        >>> with looked_up(np.linspace(-1, 1, 16, dtype=np.float32)):
        ...     round(float(maps.decode(maps.encode(jnp.array([0.1]), 4, True), 4, True)[0]), 4)
        0.0667
        >>> round(float(maps.decode(maps.encode(jnp.array([0.1]), 4, True), 4, True)[0]), 4)
        0.0861
    """
    levels_ = jnp.asarray(table, jnp.float32)
    mids = (levels_[1:] + levels_[:-1]) / 2
    module = sys.modules[__name__]
    decode_, encode_ = module.decode, module.encode

    def decode_looked_up(codes: Any, bits_: int, signed_: bool) -> jax.Array:
        if (bits_, signed_) == (bits, signed):
            return levels_[jnp.asarray(codes).astype(jnp.int32)]
        return decode_(codes, bits_, signed_)

    def encode_looked_up(y: Any, bits_: int, signed_: bool) -> jax.Array:
        if (bits_, signed_) == (bits, signed):
            return jnp.searchsorted(mids, jnp.asarray(y, jnp.float32)).astype(jnp.int32)
        return encode_(y, bits_, signed_)

    module.decode, module.encode = decode_looked_up, encode_looked_up  # type: ignore[attr-defined]
    jax.clear_caches()
    try:
        yield
    finally:
        module.decode, module.encode = decode_, encode_  # type: ignore[attr-defined]
        jax.clear_caches()
