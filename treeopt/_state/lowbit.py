"""Block-wise 8-bit and 4-bit codes for floating optimizer state.

:func:`quantize` turns a float array into a :class:`QuantizedLeaf`: one
``uint8`` code per element (4 bits: two codes per byte) and one ``float32``
scale per block; :func:`dequantize` reads it back as a float array of the
original shape and dtype. Both are pure, vectorized and jit-able.

Blocks. Blocks run along the LAST axis only, each at most 256 elements long
(:func:`block_size`: the largest divisor of the last axis in [64, 256], even
for 4 bits; failing that, 256 with a padded final block whose padding the
codes do not hold). So a shard of any other axis never cuts a block, and a
shard of the last axis keeps blocks whole exactly when the number of blocks
divides by the number of shards: the scales (``shape[:-1] + (n_blocks,)``) can
then take the same partition spec as the codes. A 1-d array is one row of
blocks; a 0-d array is one block of one element (codes and scale 0-d too).

Maps. Each block is divided by its absolute maximum (the scale) and every
element takes the nearest level of a fixed map on [-1, 1]; decoding is a
table lookup times the scale.

- Signed blocks (any element < 0) use a dynamic map, bitsandbytes' idea of an
  exponent plus a linear fraction: decade ``k`` below 1 holds ``2**(E-1-k)``
  evenly spaced levels, so precision follows magnitude. Exact 0 and ±1 are
  levels. 8 bits: 7 decades, 127 levels a side (smallest 1e-6); 4 bits:
  3 decades, 7 levels a side (smallest 0.01). One code is left over and
  repeats 1 (never produced), keeping the map symmetric.
- Unsigned blocks (every element >= 0: second moments, sums of squares) use
  a map with NO zero level, so a small positive value never decodes to 0,
  the zero-point problem of Li et al. 2023 ("Memory Efficient Optimizers
  with 4-bit States"), where a second moment read as 0 makes an update blow
  up. 8 bits: a dynamic map of 8 decades plus 1e-8, smallest level 1e-8 of
  the block maximum. 4 bits: see ``_unsigned_levels``.
  A zero in an unsigned block decodes to the smallest level times the scale.

Which map a block used is stored in the sign bit of its scale at no cost: a
negative scale (``-0.0`` included) marks the unsigned map, its magnitude is
the block's absolute maximum. The codec so serves any optax transformation
without knowing which field is a second moment.

Adversarial blocks:

- all zeros: scale 0, decodes to exact zeros;
- one huge value: it is its block's scale and decodes exactly (it is level
  ±1); the other elements of that block lose precision against it, other
  blocks are untouched, bit for bit;
- denormals: never NaN, never negative for a non-negative input; where the
  platform flushes denormals (XLA on CPU), a block of them has scale 0 and
  decodes to zeros; an unsigned block with a non-zero scale decodes to at
  least the smallest normal number of the output dtype, never to 0;
- NaN or ±inf anywhere in a block: the block's scale is NaN and the whole
  block decodes to NaN, so the failure stays visible and is never read as a
  finite wrong number; other blocks are untouched, bit for bit.

Example:
    >>> import jax.numpy as jnp
    >>> q = quantize(jnp.linspace(-1.0, 1.0, 512).reshape(2, 256), bits=8)
    >>> q.codes.shape, q.scales.shape, bytes_of(q)
    ((2, 256), (2, 1), 520)
    >>> bool(jnp.abs(q.dequantize() - jnp.linspace(-1.0, 1.0, 512).reshape(2, 256)).max() < 8e-3)
    True
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["QuantizedLeaf", "block_size", "bytes_of", "dequantize", "is_quantized", "quantize"]

_MAX_BLOCK = 256
_MIN_BLOCK = 64


@jax.tree_util.register_pytree_with_keys_class
class QuantizedLeaf:
    """A float array held as block-wise low-bit codes and a float32 scale per block.

    The pytree children are ``codes`` and ``scales``; ``shape``, ``dtype`` (its
    name), ``bits`` and ``block`` are static aux data, so a ``QuantizedLeaf``
    passes in and out of ``jit`` and ``eval_shape`` keeping them.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> q = quantize(jnp.ones((3, 5), jnp.bfloat16), bits=4)
        >>> q.shape, q.dtype, q.ndim, q.size, q.codes.shape, q.scales.shape
        ((3, 5), dtype(bfloat16), 2, 15, (3, 3), (3, 1))
        >>> q.dequantize().dtype, [leaf.dtype for leaf in jax.tree.leaves(q)]
        (dtype(bfloat16), [dtype('uint8'), dtype('float32')])
    """

    __slots__ = ("_dtype_name", "_shape", "bits", "block", "codes", "scales")

    def __init__(
        self, codes: Any, scales: Any, *, shape: tuple[int, ...], dtype: str, bits: int, block: int
    ) -> None:
        self.codes = codes
        self.scales = scales
        self._shape = tuple(shape)
        self._dtype_name = str(dtype)
        self.bits = bits
        self.block = block

    @property
    def shape(self) -> tuple[int, ...]:
        """The original array's shape."""
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        """The original array's dtype, which :meth:`dequantize` returns."""
        return jnp.dtype(self._dtype_name)

    @property
    def ndim(self) -> int:
        """The original array's number of axes."""
        return len(self._shape)

    @property
    def size(self) -> int:
        """The original array's number of elements."""
        return math.prod(self._shape)

    def dequantize(self) -> jax.Array:
        """The array these codes stand for, in its original shape and dtype (see :func:`dequantize`).

        Example:
            >>> import jax.numpy as jnp
            >>> quantize(jnp.array([0.0, 0.5, -1.0]), bits=8).dequantize()
            Array([ 0.     ,  0.49375, -1.     ], dtype=float32)
        """
        return dequantize(self)

    def tree_flatten_with_keys(self) -> tuple[tuple[tuple[Any, Any], ...], tuple[Any, ...]]:
        keys = jax.tree_util.GetAttrKey
        return ((keys("codes"), self.codes), (keys("scales"), self.scales)), self._aux()

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, ...], children: Any) -> QuantizedLeaf:
        shape, dtype, bits, block = aux
        codes, scales = children
        return cls(codes, scales, shape=shape, dtype=dtype, bits=bits, block=block)

    def _aux(self) -> tuple[Any, ...]:
        return (self._shape, self._dtype_name, self.bits, self.block)

    def __repr__(self) -> str:
        return (
            f"QuantizedLeaf(shape={self._shape}, dtype={self._dtype_name}, bits={self.bits}, "
            f"block={self.block})"
        )


def is_quantized(x: Any) -> bool:
    """Whether ``x`` is a :class:`QuantizedLeaf`.

    Example:
        >>> import jax.numpy as jnp
        >>> is_quantized(quantize(jnp.ones(4), bits=8)), is_quantized(jnp.ones(4))
        (True, False)
    """
    return isinstance(x, QuantizedLeaf)


def bytes_of(q: Any) -> int:
    """The bytes ``q`` holds: codes plus scales of a :class:`QuantizedLeaf`, or of any pytree of arrays.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.zeros((1024, 1024))
        >>> bytes_of(quantize(x, bits=8)), bytes_of(quantize(x, bits=4)), bytes_of(x)
        (1064960, 540672, 4194304)
    """
    return sum(math.prod(np.shape(leaf)) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(q))


def block_size(last_dim: int, bits: int) -> int:
    """The block length along the last axis of an array whose last axis is ``last_dim`` long.

    A whole last axis of at most 256 is one block; a longer one gets the largest
    divisor in [64, 256] (even for 4 bits, so no byte holds codes of two blocks),
    or 256 with a padded final block when there is none.

    Example:
        >>> block_size(4096, 8), block_size(1000, 8), block_size(1001, 8), block_size(1001, 4)
        (256, 250, 143, 256)
        >>> block_size(100, 8), block_size(7, 4), block_size(257, 8)
        (100, 8, 256)
    """
    _check_bits(bits)
    if last_dim <= _MAX_BLOCK:
        block = max(last_dim, 1)
        return block + block % 2 if bits == 4 else block
    step = 2 if bits == 4 else 1
    for block in range(_MAX_BLOCK, _MIN_BLOCK - 1, -step):
        if last_dim % block == 0:
            return block
    return _MAX_BLOCK


def quantize(x: Any, bits: int) -> QuantizedLeaf:
    """``x`` as block-wise ``bits``-bit codes (8 or 4) and a float32 scale per block.

    Pure and jit-able (``bits`` is a Python int). Blocks whose elements are all
    >= 0 use the unsigned map and carry a negative scale; see the module docstring.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> q = jax.jit(quantize, static_argnums=1)(jnp.array([[1.0, 0.25], [-2.0, 0.0]]), 8)
        >>> q.scales.ravel()
        Array([-1.,  2.], dtype=float32)
        >>> q.dequantize().tolist()
        [[1.0, 0.24765625596046448], [-2.0, 0.0]]
    """
    _check_bits(bits)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize takes a floating-point array, got {x.dtype}.")
    rows = x.reshape(x.shape or (1,)).astype(jnp.float32)
    last = rows.shape[-1]
    block = block_size(last, bits)
    blocks = _to_blocks(rows, block)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    finite = jnp.all(jnp.isfinite(blocks), axis=-1)
    usable = finite & (absmax > 0)
    unsigned = jnp.all(blocks >= 0, axis=-1)
    normalized = jnp.where(usable[..., None], _divide_by(blocks, jnp.where(usable, absmax, 1.0)), 0.0)
    codes = _nearest_codes(normalized, unsigned[..., None], bits)
    codes = codes.reshape((*rows.shape[:-1], codes.shape[-2] * block))[..., :last]
    if bits == 4:
        codes = _pack_nibbles(codes)
    magnitude = jnp.where(finite, jnp.where(usable, absmax, 0.0), jnp.nan)
    scales = jnp.where(unsigned, -magnitude, magnitude)
    if not x.shape:
        codes, scales = codes.reshape(()), scales.reshape(())
    return QuantizedLeaf(codes, scales, shape=x.shape, dtype=x.dtype.name, bits=bits, block=block)


def dequantize(q: QuantizedLeaf) -> jax.Array:
    """The float array ``q`` stands for, in its original shape and dtype.

    A table lookup per code times its block's scale; the sign bit of the scale
    picks the map. Pure and jit-able.

    Example:
        >>> import jax.numpy as jnp
        >>> dequantize(quantize(jnp.array([3.0, -1.5, 0.0], jnp.bfloat16), bits=8))
        Array([3, -1.48438, 0], dtype=bfloat16)
        >>> dequantize(quantize(jnp.array([0.0, 0.5, 1.0]), bits=8))  # unsigned: no zero level
        Array([9.9999999e-09, 5.0078124e-01, 1.0000000e+00], dtype=float32)
    """
    codes, scales = q.codes, q.scales
    if not q.shape:
        codes, scales = codes.reshape(1), scales.reshape(1)
    last = codes.shape[-1] if q.bits == 8 else (q.shape[-1] if q.shape else 1)
    if q.bits == 4:
        codes = _unpack_nibbles(codes, last)
    n_levels = 2**q.bits
    unsigned = jnp.signbit(scales)[..., None]
    magnitude = jnp.abs(scales)[..., None]
    index = _to_blocks(codes.astype(jnp.int32), q.block) + jnp.where(unsigned, n_levels, 0)
    values = jnp.asarray(_levels(q.bits))[index] * magnitude
    # A level times a tiny scale can underflow the output dtype; an unsigned block must not read as 0.
    floor = jnp.float32(jnp.finfo(q.dtype).smallest_normal)
    values = jnp.where(unsigned & (magnitude > 0), jnp.maximum(values, floor), values)
    values = values.reshape((*values.shape[:-2], values.shape[-2] * q.block))[..., :last]
    return values.reshape(q.shape).astype(q.dtype)


def _check_bits(bits: Any) -> None:
    if bits not in (8, 4) or isinstance(bits, bool):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}.")


def _to_blocks(rows: jax.Array, block: int) -> jax.Array:
    """``rows`` (..., L) zero-padded to whole blocks and split: (..., n_blocks, block)."""
    last = rows.shape[-1]
    n_blocks = -(-last // block)
    pad = [(0, 0)] * (rows.ndim - 1) + [(0, n_blocks * block - last)]
    return jnp.pad(rows, pad).reshape((*rows.shape[:-1], n_blocks, block))


def _divide_by(blocks: jax.Array, absmax: jax.Array) -> jax.Array:
    """``blocks / absmax[..., None]`` without ever forming a denormal ``1 / absmax``.

    XLA may divide by multiplying with the reciprocal, and ``1 / 3e38`` flushes
    to 0 where denormals do (CPU): the absmax's power of two is taken off
    exactly first, in two halves that each stay normal, leaving a divisor in [0.5, 1).
    """
    mantissa, exponent = jnp.frexp(absmax)
    half = exponent // 2
    scaled = blocks * _power_of_two(-half)[..., None] * _power_of_two(half - exponent)[..., None]
    return scaled / mantissa[..., None]


def _power_of_two(n: jax.Array) -> jax.Array:
    """2.0**n as float32, exact, for integers n in [-126, 127]: the exponent bits set directly."""
    return jax.lax.bitcast_convert_type((n.astype(jnp.int32) + 127) << 23, jnp.float32)


def _nearest_codes(normalized: jax.Array, unsigned: jax.Array, bits: int) -> jax.Array:
    """The index of the nearest level of each block's map, by arithmetic on the maps' structure.

    Each decade of a dynamic map is an even grid whose ends are levels too, so
    the nearest level of a value is found in its decade by one rounding: no
    table lookups, which on a CPU cost more than the rest of the step together.
    The 4-bit unsigned map is one even grid. ``_levels`` stays the one
    definition of the maps; a test checks these codes against the nearest
    level found by brute force.
    """
    y = jnp.abs(normalized)
    n_signed = bits - 1
    half = 2**n_signed - 1  # the index of 0 in the signed map: the negative levels come first
    k = _dynamic_index(y, n_signed, below=0.0)
    signed = jnp.where(k < 0, half, jnp.where(normalized < 0, half - 1 - k, half + 1 + k))
    if bits == 8:
        unsigned_codes = _dynamic_index(y, 8, below=float(_unsigned_levels(8)[0])) + 1
    else:
        unsigned_codes = jnp.clip(jnp.round(y * 16) - 1, 0, 15).astype(jnp.int32)
    return jnp.where(unsigned, unsigned_codes, signed).astype(jnp.uint8)


def _dynamic_index(y: jax.Array, n_decades: int, below: float) -> jax.Array:
    """The index in ``_dynamic_magnitudes(n_decades)`` of the level nearest ``y`` in [0, 1]; -1 for ``below``.

    ``below`` is the level under the smallest one (0 in a signed map).
    """
    decade = jnp.floor(jnp.log10(jnp.maximum(y, 1e-30))).astype(jnp.int32) + n_decades
    decade = jnp.clip(decade, 0, n_decades - 1)  # decade d spans (10**(d-n), 10**(d-n+1)]
    top = jnp.power(jnp.float32(10.0), (decade - n_decades + 1).astype(jnp.float32))
    steps = jnp.left_shift(1, decade)  # its levels: top * (0.1 + 0.9 * j / steps), j = 1 .. steps
    j = jnp.clip(jnp.round((y / top - 0.1) * steps.astype(jnp.float32) / 0.9), 0, steps).astype(jnp.int32)
    index = steps - 2 + j  # j = 0 is the top of the decade below
    smallest = 10.0 ** (1 - n_decades)  # the lowest decade's only level, with ``below`` under it
    return jnp.where(y < smallest, jnp.where(y >= 0.5 * (smallest + below), 0, -1), index)


def _pack_nibbles(codes: jax.Array) -> jax.Array:
    """Codes below 16 two to a byte along the last axis: element 2j in the low nibble, 2j+1 in the high."""
    if codes.shape[-1] % 2:
        codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, 1)])
    pairs = codes.reshape((*codes.shape[:-1], codes.shape[-1] // 2, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack_nibbles(packed: jax.Array, last: int) -> jax.Array:
    pairs = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    return pairs.reshape((*packed.shape[:-1], 2 * packed.shape[-1]))[..., :last]


def _dynamic_magnitudes(n_decades: int) -> np.ndarray:
    """Exponent plus linear fraction: decade k below 1 has 2**(n_decades-1-k) levels, 1 included.

    Levels are the right ends of equal steps over (0.1, 1] times the decade's
    power of ten, so the decades tile (10**-n_decades, 1] with no duplicates.
    """
    decades = [
        10.0 ** (i - n_decades + 1) * np.linspace(0.1, 1.0, 2**i + 1)[1:] for i in range(n_decades)
    ]
    return np.concatenate(decades)


def _signed_levels(bits: int) -> np.ndarray:
    magnitudes = _dynamic_magnitudes(bits - 1)
    return np.concatenate([-magnitudes[::-1], [0.0], magnitudes, [1.0]])


def _unsigned_levels(bits: int) -> np.ndarray:
    """Maps with no zero level for blocks of non-negative values.

    8 bits: the dynamic map over 8 decades plus 1e-8 (smallest level 1e-8 of
    the block maximum, top decade 128 levels): bitsandbytes' unsigned map
    without its zero. 4 bits: 16 evenly spaced levels 1/16 .. 1, the linear
    map without zero Li et al. chose for second moments (torchao does the
    same). With 16 codes a dynamic map spends most of them on small values
    and leaves the top, where the block's largest second moments sit, with
    steps of 0.11; linear halves that worst error and rounds small values UP
    (to 1/16 of the maximum), which shrinks their updates instead of inflating
    them. In an Adam loop of random gradients it gave the smaller update error
    of the two at every spread of scales within a block up to one decade.
    """
    if bits == 8:
        return np.concatenate([[1e-8], _dynamic_magnitudes(8)])
    return np.linspace(0.0, 1.0, 17)[1:]


@functools.cache
def _levels(bits: int) -> np.ndarray:
    """Both sorted maps as one float32 table: the signed map, then the unsigned one."""
    table = np.concatenate([_signed_levels(bits), _unsigned_levels(bits)]).astype(np.float32)
    table.flags.writeable = False
    return table
