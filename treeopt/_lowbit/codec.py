"""Block-wise 8-bit and 4-bit codes for floating optimizer state, and their format.

:func:`quantize` turns a float array into a :class:`QuantizedLeaf`: one code
per element (one byte at 8 bits, two codes a byte at 4 bits) and one scale
per block, the block's absolute maximum; :meth:`QuantizedLeaf.dequantize`
reads it back in the original shape and dtype. Each element takes the nearest
level of a fixed map on [-1, 1] (signed: moments) or (0, 1] (unsigned: second
moments, which must never read as 0); the maps are in
:mod:`treeopt._lowbit.maps`.

**The format travels with the codes** (:class:`Format`): bits, map, block
layout and map version are static data of the leaf, and a state dict holds
them beside ``codes`` and ``scales`` as a small ``format`` entry
(:meth:`Format.entry`), so nothing is inferred from shapes.

**Blocks** (:func:`block_layout`). A block is at most 256 elements (128 at 4
bits) of the array's last axes read as one row: the axes from
``Format.axis`` on are flattened, and each such row is cut into blocks of
``Format.block`` elements (the last one shorter when they do not divide). A
long last axis holds whole blocks; a short one lets a block span several
rows, so that every leaf of 4,096 elements or more pays about 1/64 byte per
element for its scales (2.03 bytes a parameter for Adam at 8 bits, 1.06 at 4).
A ZeRO shard of the state keeps blocks whole; a model-parallel spec that cuts
a block makes its maximum a small reduction across devices.

**Storage.** 8-bit codes have the array's own shape, so they take its
partition spec. 4-bit codes are two to a byte, a row at a time (a row: the
axes from ``Format.axis`` on, flattened): the row's first half in the low
nibbles of its bytes, its second half in the high ones, so ``codes.shape`` is
``shape[:axis] + (ceil(row / 2),)`` (a ``(3, 64)`` array read from axis 0 has
96 bytes of codes, ``(96,)``) and a shard may split the axes before the rows,
never a row. Scales are ``shape[:axis] + (blocks per row,)``, float32 (float64
for float64 arrays). A block of zeros has scale 0 and decodes to exact zeros; a block
holding NaN or an infinity has scale NaN and decodes to NaN entirely, so the
failure stays visible, and other blocks are untouched.

Example:
    >>> import jax.numpy as jnp
    >>> q = quantize(jnp.linspace(-1.0, 1.0, 512).reshape(2, 256), bits=8)
    >>> q.codes.shape, q.scales.shape, bytes_of(q)
    ((2, 256), (2, 1), 520)
    >>> bool(jnp.abs(q.dequantize() - jnp.linspace(-1.0, 1.0, 512).reshape(2, 256)).max() < 0.02)
    True
    >>> q4 = quantize(jnp.ones((3, 64)), bits=4)   # rows from axis 0: one row of 192 codes, 96 bytes
    >>> q4.format.axis, q4.codes.shape, q4.scales.shape
    (0, (96,), (2,))
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from treeopt._lowbit import maps as lowbit_maps
from treeopt._lowbit.format import (
    FORMAT_VERSION,
    Format,
    block_layout,
    check_bits,
    codes_shape,
    describe_entry,
    partition_entries,
    scales_shape,
    uncut_spec,
    zero_axes,
)
from treeopt._sharding.explicit import explicit_sharding
from treeopt._sharding.specs import SpecifiesItself, spec_of_entries

__all__ = [
    "FORMAT_VERSION",
    "Format",
    "QuantizedLeaf",
    "block_layout",
    "block_maxima",
    "bytes_of",
    "codes_shape",
    "constant",
    "dequantize",
    "describe_entry",
    "encode_with",
    "is_quantized",
    "quantize",
    "scales_shape",
]


class QuantizedLeaf(SpecifiesItself):
    """A float array held as block-wise low-bit ``codes`` and one ``scales`` entry per block.

    The pytree children are ``codes`` and ``scales``; the shape, dtype and
    :class:`Format` are static data, so a ``QuantizedLeaf`` passes in and
    out of ``jit`` and ``eval_shape`` keeping them. It answers for its own
    partition specs (:meth:`partition_specs`) and for the axes a ZeRO shard
    may take (:meth:`zero_axes`), as flax's ``AxisMetadata`` does for boxed
    params: it is a :class:`~treeopt._sharding.specs.SpecifiesItself`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> q = quantize(jnp.ones((3, 64), jnp.bfloat16), bits=4, signed=False)
        >>> q.shape, q.dtype, q.codes.shape, q.scales.shape, q.format.block
        ((3, 64), dtype(bfloat16), (96,), (2,), 96)
        >>> q.dequantize().dtype, [leaf.dtype for leaf in jax.tree.leaves(q)]
        (dtype(bfloat16), [dtype('uint8'), dtype('float32')])
    """

    __slots__ = ("_dtype_name", "_shape", "codes", "format", "scales")

    def __init__(self, codes: Any, scales: Any, *, shape: Sequence[int], dtype: Any, format: Format) -> None:
        self.codes = codes
        self.scales = scales
        self._shape = tuple(int(d) for d in shape)
        self._dtype_name = np.dtype(dtype).name
        self.format = format

    @property
    def shape(self) -> tuple[int, ...]:
        """The original array's shape."""
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        """The original array's dtype, which :meth:`dequantize` returns."""
        return jnp.dtype(self._dtype_name)

    @property
    def bits(self) -> int:
        """8 or 4."""
        return self.format.bits

    @property
    def block(self) -> int:
        """The number of elements a scale covers."""
        return self.format.block

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
            Array([ 0. ,  0.5, -1. ], dtype=float32)
        """
        return dequantize(self)

    def partition_specs(self, param_spec: PartitionSpec, axis_sizes: Mapping[str, int] | None = None) -> Any:
        """This leaf with a ``PartitionSpec`` for its codes and its scales, from its parameter's spec.

        8-bit codes take the parameter's spec; 4-bit codes keep the entries of
        the axes before their rows. The scales keep those too, and the entry of
        the axis blocks start on where every shard holds whole blocks: with
        ``axis_sizes``, the mesh axes' sizes, that is checked; without them it
        is dropped.

        Example:
            >>> import jax.numpy as jnp
            >>> from jax.sharding import PartitionSpec as P
            >>> q = quantize(jnp.ones((64, 512)), bits=8)
            >>> specs = q.partition_specs(P("data", "model"))
            >>> specs.codes == P("data", "model"), specs.scales == P("data")
            (True, True)
            >>> q.partition_specs(P("data", "model"), {"data": 8, "model": 2}).scales == P("data", "model")
            True
        """
        codes, scales = partition_entries(self._shape, self.format, param_spec, axis_sizes)
        return QuantizedLeaf(codes, scales, shape=self._shape, dtype=self._dtype_name, format=self.format)

    def laid_out_as_param(self) -> Any:
        """Its 8-bit codes, which have the parameter's shape and layout; ``None`` for 4-bit codes (packed).

        Example:
            >>> import jax.numpy as jnp
            >>> quantize(jnp.ones((64, 64)), bits=8).laid_out_as_param().shape
            (64, 64)
            >>> quantize(jnp.ones((64, 64)), bits=4).laid_out_as_param() is None
            True
        """
        return self.codes if tuple(self.codes.shape) == self._shape else None

    def zero_axes(
        self, param_spec: PartitionSpec, shards: int, axis_sizes: Mapping[str, int] | None = None
    ) -> list[int]:
        """The axes of the parameter a ZeRO shard of ``1 / shards`` may take, keeping whole blocks and bytes.

        An axis the parameter's spec splits is offered only with ``axis_sizes``
        (the mesh's), where the ZeRO shards combine with its mesh axes into
        parts that keep whole blocks. An axis before ``format.axis`` always
        keeps blocks whole; ``format.axis`` itself when each shard's rows hold
        whole blocks; later axes never.

        Example:
            >>> import jax.numpy as jnp
            >>> from jax.sharding import PartitionSpec as P
            >>> q = quantize(jnp.ones((64, 512)), bits=8)   # blocks of 256 along the last axis
            >>> q.zero_axes(P(), 2), q.zero_axes(P(), 8), q.zero_axes(P("data"), 2)
            ([0, 1], [0], [1])
        """
        return zero_axes(self._shape, self.format, param_spec, shards, axis_sizes)

    def __repr__(self) -> str:
        return f"QuantizedLeaf(shape={self._shape}, dtype={self._dtype_name}, {self.format.describe()})"


def _to_state_dict(q: QuantizedLeaf) -> dict[str, Any]:
    return {"codes": q.codes, "scales": q.scales, "format": q.format.entry()}


def _from_state_dict(target: QuantizedLeaf, state: Mapping[str, Any]) -> QuantizedLeaf:
    if "format" in state and Format.from_entry(state["format"]) != target.format:
        raise ValueError(
            f"low-bit state of format {Format.from_entry(state['format']).describe()} cannot restore into "
            f"{target.format.describe()}: convert it with treeopt.serialization.warm_start."
        )
    return QuantizedLeaf(
        state["codes"], state["scales"], shape=target.shape, dtype=target.dtype, format=target.format
    )


# The arrays are its leaves; what they stand for is static data (the jit cache key).
jax.tree_util.register_dataclass(
    QuantizedLeaf, data_fields=["codes", "scales"], meta_fields=["shape", "dtype", "format"]
)
# A state dict holds a low-bit leaf as its codes, its scales and its format (Format.entry).
flax.serialization.register_serialization_state(QuantizedLeaf, _to_state_dict, _from_state_dict)


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
        (1064960, 557056, 4194304)
    """
    return sum(math.prod(np.shape(leaf)) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(q))


# -- encoding and decoding -------------------------------------------------------------------------


def quantize(x: Any, bits: int, *, signed: bool = True, fmt: Format | None = None) -> QuantizedLeaf:
    """``x`` as block-wise ``bits``-bit codes (8 or 4) and a scale per block.

    ``signed=False`` takes the map without a zero level, for values that are
    never negative (negative ones read as its smallest level). ``fmt`` gives
    the layout (a state's own, when re-encoding); by default
    :func:`block_layout` picks it. Pure and jit-able.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> q = jax.jit(quantize, static_argnums=1)(jnp.array([[1.0, 0.25], [-2.0, 0.0]]), 8)
        >>> q.scales, q.format.describe()
        (Array([2.], dtype=float32), '8-bit signed, blocks of 4 from axis 0')
        >>> q.dequantize().tolist()
        [[1.0, 0.25], [-2.0, 0.0]]
    """
    check_bits(bits)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"quantize takes a floating-point array, got {x.dtype}.")
    if fmt is None:
        axis, block = block_layout(x.shape, bits)
        fmt = Format(bits=bits, signed=signed, axis=axis, block=block)
    return encode_with(x, block_maxima(x, fmt), fmt)


def block_maxima(x: Any, fmt: Format) -> jax.Array:
    """The absolute maximum of each block of ``x`` in the layout of ``fmt`` (NaN where a block is not finite).

    The maxima of eight slices of each block (four where its length is not a
    multiple of eight) are taken first, elementwise: XLA fuses that into the
    loop that computes ``x``, so only an eighth of it is written out for the
    reduction.

    Example:
        >>> import jax.numpy as jnp
        >>> block_maxima(jnp.array([[1.0, -3.0], [2.0, jnp.inf]]), Format(8, True, 1, 2)).tolist()
        [[3.0], [nan]]
    """
    x = _uncut(jnp.asarray(x), x.shape, fmt)
    compute = _compute_dtype(x.dtype)
    magnitude = jnp.abs(x.astype(compute))
    blocks = _blocked(magnitude, x.shape, fmt, pad=0)
    # The bits of a non-negative float order like the float, NaN above infinity: a maximum by
    # integer comparison keeps NaN, which XLA's float reductions on a CPU may drop.
    as_int = jnp.int64 if compute == jnp.float64 else jnp.int32
    fan = 8 if fmt.block % 8 == 0 else 4
    if fmt.block % fan == 0:  # as selects, the first maxima stay a loop XLA fuses the values into
        parts = [jax.lax.bitcast_convert_type(part, as_int) for part in _fan_parts(blocks, fan)]
        while len(parts) > 1:
            parts = [jnp.where(a > b, a, b) for a, b in zip(parts[::2], parts[1::2], strict=True)]
        bits = parts[0]
    else:
        bits = jax.lax.bitcast_convert_type(blocks, as_int)
    maxima = jax.lax.bitcast_convert_type(jnp.max(bits, axis=-1), compute)
    return jnp.where(jnp.isfinite(maxima), maxima, jnp.nan).reshape(scales_shape(x.shape, fmt))


def _fan_parts(blocks: jax.Array, fan: int) -> list[jax.Array]:
    """``fan`` slices of each block, together all of it, whose elementwise maximum keeps the block's maximum.

    On one device, contiguous runs: XLA reads each with whole vector loads.
    Where a mesh may split the blocks' axis, every ``fan``-th element instead:
    a contiguous run of a split axis would be moved between devices, a
    strided slice of it stays where it is. (Slices, not a strided index: at
    JAX 0.7 that is a gather, which explicit sharding refuses.)
    """
    if not _slices_may_be_sharded():
        run = blocks.shape[-1] // fan
        return [jax.lax.slice_in_dim(blocks, i * run, (i + 1) * run, axis=-1) for i in range(fan)]
    return [jax.lax.slice_in_dim(blocks, i, None, fan, -1) for i in range(fan)]


def _slices_may_be_sharded() -> bool:
    """Whether a mesh could split the arrays of this process: more than one device."""
    return jax.device_count() > 1


def encode_with(x: Any, maxima: Any, fmt: Format) -> QuantizedLeaf:
    """``x`` encoded against the block ``maxima`` given (from :func:`block_maxima` of ``x``, or of the same values).

    Elements beyond their block's maximum read as +-1 times it; a block whose
    maximum is 0 reads as zeros, one whose maximum is NaN as NaN.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([0.5, -1.0])
        >>> fmt = Format(8, True, 0, 2)
        >>> encode_with(x, block_maxima(x, fmt), fmt).dequantize()
        Array([ 0.5, -1. ], dtype=float32)
    """
    x = _uncut(jnp.asarray(x), x.shape, fmt)
    compute = _compute_dtype(x.dtype)
    maxima = _uncut(jnp.asarray(maxima, compute), x.shape, fmt)
    # 1 / maximum is denormal (flushed to 0 on CPU) above 2**126: such blocks are scaled down first.
    big = maxima > 2.0**100
    pre = jnp.where(big, np.asarray(2.0**-64, compute), np.asarray(1.0, compute))
    usable = maxima > 0  # False for 0 and NaN
    inverse = jnp.where(usable, 1 / jnp.where(usable, maxima * pre, 1), 0)
    y = x.astype(compute) * _broadcast(pre, x.shape, fmt) * _broadcast(inverse, x.shape, fmt)
    # No clip to [-1, 1]: each encoder saturates beyond it (a NaN-aware clip costs four vector
    # instructions an element, in the loop that bounds the step's time on a CPU).
    y = y.astype(jnp.float32)  # unsigned encoders give code 0 below 0; a NaN's code is never read
    codes = lowbit_maps.encode(y, fmt.bits, fmt.signed).astype(jnp.uint8)
    if fmt.bits == 4:
        codes = _pack(codes, fmt)
    return QuantizedLeaf(
        codes, maxima.astype(_compute_dtype(x.dtype)), shape=x.shape, dtype=x.dtype, format=fmt
    )


def dequantize(q: QuantizedLeaf) -> jax.Array:
    """The float array ``q`` stands for, in its original shape and dtype.

    Each code's level times its block's scale. An unsigned block with a
    positive scale never reads 0: its smallest level is kept at least at the
    smallest positive number of the output dtype (float16's subnormals
    included). Pure and jit-able.

    Example:
        >>> import jax.numpy as jnp
        >>> dequantize(quantize(jnp.array([3.0, -1.5, 0.0], jnp.bfloat16), bits=8))
        Array([3, -1.5, 0], dtype=bfloat16)
        >>> dequantize(quantize(jnp.array([0.0, 0.5, 1.0]), bits=8, signed=False))  # no zero level
        Array([1.9073486e-06, 5.0000000e-01, 1.0000000e+00], dtype=float32)
    """
    fmt = q.format
    _refuse_batched(q)
    codes = _uncut(jnp.asarray(q.codes), q.shape, fmt)
    codes = _unpack(codes, q.shape, fmt) if fmt.bits == 4 else codes
    compute = _compute_dtype(q.dtype)
    scales = _uncut(jnp.asarray(q.scales), q.shape, fmt).astype(compute)
    values = lowbit_maps.decode(codes, fmt.bits, fmt.signed).astype(compute) * _broadcast(
        scales, q.shape, fmt
    )
    if not fmt.signed:
        tiny = max(float(jnp.finfo(q.dtype).smallest_subnormal), float(jnp.finfo(compute).smallest_normal))
        floor = jnp.where(scales > 0, np.asarray(tiny, compute), np.asarray(0, compute))
        values = _larger_of_nonnegative(values, _broadcast(floor, q.shape, fmt))
    return values.astype(q.dtype)


def _refuse_batched(q: QuantizedLeaf) -> None:
    """A ``ValueError`` for codes and scales with leading axes the leaf's shape lacks: a leaf made under ``jax.vmap``.

    ``vmap`` adds its axis to the children (codes and scales), not to the
    shape and format in the aux data, so outside ``vmap`` the leaf describes
    one member of the batch.
    """
    codes, scales = tuple(np.shape(q.codes)), tuple(np.shape(q.scales))
    want_codes, want_scales = codes_shape(q.shape, q.format), scales_shape(q.shape, q.format)
    if codes == want_codes and scales == want_scales:
        return
    extra = len(codes) - len(want_codes)
    if extra > 0 and codes[extra:] == want_codes and scales[extra:] == want_scales and codes[:extra] == scales[:extra]:
        raise ValueError(
            f"this QuantizedLeaf of shape {q.shape} holds a batch: its codes and scales have the leading "
            f"axes {codes[:extra]} that jax.vmap added (the shape and format describe one member). "
            "Dequantize it under the same vmap: jax.vmap(lambda q: q.dequantize())(leaf)."
        )
    raise ValueError(
        f"this QuantizedLeaf of shape {q.shape} ({q.format.describe()}) has codes of shape {codes} and "
        f"scales of shape {scales}, where its format makes {want_codes} and {want_scales}."
    )


def _larger_of_nonnegative(a: jax.Array, b: jax.Array) -> jax.Array:
    """The elementwise maximum of two arrays of non-negative floats (or NaN), compared by their bits.

    As unsigned integers the bits order like the floats, and any NaN lies
    above them all, so a NaN wins as ``jnp.maximum`` keeps it: one integer
    instruction where a NaN-aware float maximum is three or four.
    """
    unsigned = jnp.uint64 if a.dtype == jnp.float64 else jnp.uint32
    bits = jnp.maximum(jax.lax.bitcast_convert_type(a, unsigned), jax.lax.bitcast_convert_type(b, unsigned))
    return jax.lax.bitcast_convert_type(bits, a.dtype)


def constant(value: float, shape: Sequence[int], dtype: Any, fmt: Format) -> QuantizedLeaf:
    """The codes of an array of ``shape`` filled with ``value``, built directly rather than computed.

    Every element is its block's maximum: the code of +-1 (or the unsigned
    top), and ``|value|`` as every scale (0 for zeros). ``jit`` of an ``init``
    then holds two broadcast constants, not an encoder for XLA to fold.

    Example:
        >>> import jax.numpy as jnp
        >>> q = constant(0.0, (64, 64), jnp.float32, Format(8, True, 0, 256))
        >>> q.codes.shape, q.scales.shape, float(jnp.abs(q.dequantize()).max())
        ((64, 64), (16,), 0.0)
        >>> constant(-0.5, (4,), jnp.float32, Format(4, True, 0, 4)).dequantize()
        Array([-0.5, -0.5, -0.5, -0.5], dtype=float32)
    """
    shape = tuple(shape)
    if value != value or value in (float("inf"), float("-inf")):
        scale, level = float("nan"), 1.0
    else:
        scale, level = abs(value), (-1.0 if value < 0 else 1.0)
    if not fmt.signed:
        level = 1.0
    table = lowbit_maps.levels(fmt.bits, fmt.signed)  # a Python int from the table: nothing to compile
    code = int(np.argmin(np.abs(table.astype(np.float64) - (level if scale else 0.0))))
    byte = code | (code << 4) if fmt.bits == 4 else code
    codes = jnp.full(codes_shape(shape, fmt), byte, jnp.uint8)
    scales = jnp.full(scales_shape(shape, fmt), scale, _compute_dtype(dtype))
    return QuantizedLeaf(codes, scales, shape=shape, dtype=dtype, format=fmt)


def _uncut(x: jax.Array, shape: Sequence[int], fmt: Format) -> jax.Array:
    """``x`` (the values of an array of ``shape`` in ``fmt``, its codes or its scales) in a layout no shard cuts
    a block of: under JAX's explicit mesh axes the reshapes into blocks are refused otherwise.

    Off an explicit mesh, or where every shard holds whole blocks, ``x`` itself
    (the compiler already moves what a reduction across shards needs). Where a
    model shard cuts blocks (a ``(64, 512)`` kernel over ``model=4`` with
    blocks of 256), the axes that cut them are gathered for the codec's work.
    """
    sharding = explicit_sharding(x)
    if sharding is None:
        return x
    sizes = {str(name): int(size) for name, size in dict(sharding.mesh.shape).items()}
    spec = uncut_spec(shape, fmt, sharding.spec, sizes)
    if tuple(spec) == tuple(spec_of_entries(sharding.spec)):
        return x
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(sharding.mesh, spec))


def _compute_dtype(dtype: Any) -> Any:
    """float32, float64 for float64 arrays: the dtype codes are computed in and scales are held in, so a
    float64 moment beyond float32's range stays finite."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _blocked(x: jax.Array, shape: Sequence[int], fmt: Format, pad: Any) -> jax.Array:
    """``x`` (of ``shape``) as ``shape[:axis] + (blocks per row, block)``, rows padded with ``pad``."""
    shape = tuple(shape) or (1,)
    rows = x.reshape((*shape[: fmt.axis], math.prod(shape[fmt.axis :])))
    n_blocks = -(-rows.shape[-1] // fmt.block)
    extra = n_blocks * fmt.block - rows.shape[-1]
    if extra:
        rows = jnp.pad(rows, [(0, 0)] * (rows.ndim - 1) + [(0, extra)], constant_values=pad)
    return rows.reshape((*rows.shape[:-1], n_blocks, fmt.block))


def _broadcast(per_block: jax.Array, shape: Sequence[int], fmt: Format) -> jax.Array:
    """One value per block spread over the elements of an array of ``shape``."""
    shape = tuple(shape)
    if not shape:
        return per_block.reshape(())
    row = math.prod(shape[fmt.axis :])
    lead = shape[: fmt.axis]
    n_blocks = per_block.shape[-1]
    spread = jnp.broadcast_to(per_block[..., None], (*lead, n_blocks, fmt.block))
    spread = spread.reshape((*lead, n_blocks * fmt.block))
    if n_blocks * fmt.block != row:
        spread = spread[..., :row]
    return spread.reshape(shape)


def _pack(codes: jax.Array, fmt: Format) -> jax.Array:
    """4-bit codes two to a byte: each row's first half in the low nibbles, its second half in the high ones.

    A row is the flattened axes from ``fmt.axis`` on (padded to an even
    length). Pairing halves keeps unpacking to one concatenation of contiguous
    halves: on a CPU XLA writes it out, one byte an element, rather than fuse
    it into the loops that read the codes, and still that is the cheapest
    unpacking measured (pairing neighbours, or slicing halves apart, cost it
    three to ten times more; broadcast shifts, or pads and a select, made the
    4-bit step about twice as slow). The halves are paired by a swap of axes
    and read as 16-bit words, elementwise work XLA vectorizes. The price: a
    shard may split the axes before ``fmt.axis``, not the row itself.
    """
    shape = tuple(codes.shape)
    lead = shape[: fmt.axis]
    rows = codes.reshape((*lead, math.prod(shape[fmt.axis :]) if shape else 1))
    if rows.shape[-1] % 2:
        rows = jnp.pad(rows, [(0, 0)] * len(lead) + [(0, 1)])
    halves = rows.reshape((*lead, 2, rows.shape[-1] // 2))
    words = jax.lax.bitcast_convert_type(jnp.swapaxes(halves, -1, -2), jnp.uint16)  # first half: low byte
    packed = ((words & 0xF) | ((words >> 4) & 0xF0)).astype(jnp.uint8)
    return packed.reshape(codes_shape(shape, fmt))


def _unpack(packed: jax.Array, shape: Sequence[int], fmt: Format) -> jax.Array:
    shape = tuple(shape)
    row = math.prod(shape[fmt.axis :]) if shape else 1
    bytes_ = packed.reshape((*shape[: fmt.axis], -(-row // 2)))
    codes = jnp.concatenate([bytes_ & 0xF, bytes_ >> 4], axis=-1)
    if codes.shape[-1] != row:
        codes = codes[..., :row]
    return codes.reshape(shape)
