"""The format of low-bit codes: bits, map and block layout, and where a shard may cut them.

A :class:`Format` is static data of a :class:`~treeopt._lowbit.codec.QuantizedLeaf`
and travels in a state dict as a small integer ``format`` entry.
:func:`block_layout` picks the layout from an array's shape alone;
:func:`codes_shape` and :func:`scales_shape` follow from it. A shard keeps
blocks (and 4-bit bytes) whole: :func:`partition_entries` and
:func:`zero_axes` say which axes a mesh axis may split.

Example:
    >>> fmt = Format(8, True, *block_layout((64, 512), 8))
    >>> fmt.describe(), codes_shape((64, 512), fmt), scales_shape((64, 512), fmt)
    ('8-bit signed, blocks of 256 from axis 1', (64, 512), (64, 2))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from treeopt._sharding.specs import axis_names_of, spec_of_entries

__all__ = [
    "FORMAT_VERSION",
    "Format",
    "block_layout",
    "check_bits",
    "codes_shape",
    "describe_entry",
    "partition_entries",
    "scales_shape",
    "uncut_spec",
    "zero_axes",
]

FORMAT_VERSION = 2
"""The version of the maps and layout written today; version 1 (no ``format`` entry) still loads."""

_MAX_BLOCK = {8: 256, 4: 128}
# The bytes per element a layout should cost (codes and scales) to keep Adam at <= 2.05 / 1.07 B/param.
_TARGET_BYTES = {8: 1.025, 4: 0.535}


@dataclasses.dataclass(frozen=True)
class Format:
    """How a :class:`QuantizedLeaf`'s codes are laid out and read.

    Attributes:
        bits: 8 or 4.
        signed: the signed map (exact 0 and +-1) or the unsigned one (no zero level).
        axis: the axes from ``axis`` on are read as one row, cut into blocks.
        block: the number of elements of a block.
        version: the version of the maps and layout (:data:`FORMAT_VERSION`).

    Example:
        >>> fmt = Format(bits=8, signed=False, axis=0, block=256)
        >>> fmt.entry(), Format.from_entry(fmt.entry()) == fmt
        (array([  2,   8,   0,   0, 256], dtype=int32), True)
    """

    bits: int
    signed: bool
    axis: int
    block: int
    version: int = FORMAT_VERSION

    def entry(self) -> np.ndarray:
        """The format as the ``format`` entry of a state dict: ``int32[version, bits, signed, axis, block]``."""
        return np.array([self.version, self.bits, int(self.signed), self.axis, self.block], np.int32)

    @classmethod
    def from_entry(cls, entry: Any) -> Format:
        """The format a state dict's ``format`` entry describes; ``ValueError`` for one this version cannot read.

        Example:
            >>> Format.from_entry([2, 8, 1, 0, 0])
            Traceback (most recent call last):
            ...
            ValueError: low-bit format [2, 8, 1, 0, 0] is not valid: block 0, expected 1 to 256 elements at 8 bits
        """
        values = [int(v) for v in np.asarray(entry).reshape(-1)]
        if len(values) != 5 or values[0] != FORMAT_VERSION:
            raise ValueError(
                f"unknown low-bit format {values}: expected [version {FORMAT_VERSION}, bits 8 or 4, signed 0 "
                "or 1, axis, block] (saved by a newer treeopt?)"
            )
        problem = _entry_problem(*values[1:])
        if problem is not None:
            raise ValueError(f"low-bit format {values} is not valid: {problem}")
        return cls(bits=values[1], signed=bool(values[2]), axis=values[3], block=values[4], version=values[0])

    @classmethod
    def for_leaf(
        cls, entry: Any, shape: Sequence[int], codes: Sequence[int], scales: Sequence[int], signed: bool | None
    ) -> Format | None:
        """The format of a state dict's leaf, checked against its codes and scales; ``None`` for another version.

        ``ValueError`` saying why it cannot describe the leaf: not a valid
        format, codes or scales that another layout makes, an axis beyond the
        leaf's rank, or the map of the other sign than ``signed`` (``None``:
        either).

        Example:
            >>> Format.for_leaf([2, 8, 0, 1, 256], (64, 512), (64, 512), (64, 2), signed=True)
            Traceback (most recent call last):
            ...
            ValueError: the unsigned map, where the leaf is a signed statistic
        """
        values = [int(v) for v in np.asarray(entry).reshape(-1)]
        if len(values) != 5 or values[0] != FORMAT_VERSION:
            return None  # a newer version: not this one's to judge
        problem = _entry_problem(*values[1:])
        fmt = cls.from_entry(values) if problem is None else None
        if fmt is not None:
            problem = fmt.misfit(shape, codes, scales)
        if fmt is not None and problem is None and signed is not None and fmt.signed != signed:
            problem = f"the {'signed' if fmt.signed else 'unsigned'} map, where the leaf is {'a signed' if signed else 'an unsigned'} statistic"
        if problem is not None:
            raise ValueError(problem)
        return fmt

    def misfit(
        self, shape: Sequence[int], codes: Sequence[int] | None = None, scales: Sequence[int] | None = None
    ) -> str | None:
        """Why this format cannot describe a leaf of ``shape`` with codes and scales of these shapes (``None``: it can).

        Example:
            >>> fmt = Format(8, True, 1, 256)
            >>> fmt.misfit((64, 512), (64, 512), (64, 2)) is None, fmt.misfit((512,))
            (True, 'axis 1 of a 1-d leaf')
            >>> fmt.misfit((64, 512), (64, 512), (64, 3))
            'scales of shape (64, 3) where blocks of 256 from axis 1 of (64, 512) make (64, 2)'
        """
        shape = tuple(int(d) for d in shape)
        if self.axis >= max(len(shape), 1):
            return f"axis {self.axis} of a {len(shape)}-d leaf"
        for part, given, expected in (("codes", codes, codes_shape), ("scales", scales, scales_shape)):
            want = expected(shape, self)
            if given is not None and tuple(given) != want:
                return (
                    f"{part} of shape {tuple(given)} where blocks of {self.block} from axis {self.axis} of "
                    f"{shape} make {want}"
                )
        return None

    def describe(self) -> str:
        """A short readable form: ``"8-bit signed, blocks of 256 from axis 1"``.

        Example:
            >>> Format(4, True, 0, 128).describe()
            '4-bit signed, blocks of 128 from axis 0'
        """
        kind = "signed" if self.signed else "unsigned"
        return f"{self.bits}-bit {kind}, blocks of {self.block} from axis {self.axis}"


def describe_entry(entry: Any) -> str:
    """A state dict's ``format`` entry in words, for error messages.

    Example:
        >>> describe_entry(Format(8, True, 1, 256).entry())
        'format [2, 8, 1, 1, 256] (8-bit signed, blocks of 256 from axis 1)'
    """
    values = np.asarray(entry).reshape(-1).tolist()
    try:
        return f"format {values} ({Format.from_entry(entry).describe()})"
    except ValueError as error:
        reason = str(error).split(": ", 1)[-1] if "is not valid" in str(error) else None
        return f"format {values}" + (f" (not valid: {reason})" if reason else "")


def _entry_problem(bits: int, signed: int, axis: int, block: int) -> str | None:
    """What a ``format`` entry of today's version holds that no format has (``None``: nothing)."""
    if bits not in _MAX_BLOCK:
        return f"bits {bits}, expected 8 or 4"
    if signed not in (0, 1):
        return f"signed {signed}, expected 0 or 1"
    if axis < 0:
        return f"axis {axis}, expected 0 or more"
    if not 1 <= block <= _MAX_BLOCK[bits]:
        return f"block {block}, expected 1 to {_MAX_BLOCK[bits]} elements at {bits} bits"
    return None


# -- layout ----------------------------------------------------------------------------------------


def block_layout(shape: Sequence[int], bits: int) -> tuple[int, int]:
    """``(axis, block)``: the axes from ``axis`` on form a row cut into blocks of ``block`` elements.

    The latest axis whose rows give blocks of at most 256 elements (128 at 4
    bits) costing at most 1.025 (0.535) bytes per element with their scales;
    a block that divides its row is preferred (a ZeRO shard of the row then
    keeps whole blocks), else the last block of each row is shorter. The
    layout follows the array's shape alone, so a sharded optimizer steps
    exactly as an unsharded one does.

    Example:
        >>> block_layout((1024, 4096), 8), block_layout((128, 64), 8), block_layout((8192, 1), 4)
        ((1, 256), (0, 256), (0, 128))
        >>> block_layout((64, 4, 64), 8), block_layout((96, 96), 8), block_layout((1000, 150), 8)
        ((1, 256), (0, 256), (0, 240))
    """
    check_bits(bits)
    shape = tuple(int(d) for d in shape) or (1,)
    best: tuple[float, int, int] | None = None
    for axis in reversed(range(len(shape))):
        row = math.prod(shape[axis:])
        for block in _blocks_for(row, bits):
            cost = _bytes_per_element(row, block, bits)
            if cost <= _TARGET_BYTES[bits]:
                return axis, block
            if best is None or cost < best[0]:
                best = (cost, axis, block)
    assert best is not None
    return best[1], best[2]


def _blocks_for(row: int, bits: int) -> list[int]:
    """Block lengths for rows of ``row`` elements, best first: all of it when short, else the largest fitting
    divisor, then the longest block with a shorter last one."""
    largest = _MAX_BLOCK[bits]
    if row <= largest:
        return [max(row + row % 2 if bits == 4 else row, 1)]
    smallest, step = largest * 5 // 8, 8 if bits == 8 else 4  # slices of eight (four) for the block maxima
    found = [block for block in range(largest, smallest - 1, -step) if row % block == 0][:1]
    return [*found, largest]


def _bytes_per_element(row: int, block: int, bits: int) -> float:
    return (math.ceil(row * bits / 8) + 4 * math.ceil(row / block)) / row


def _blocks_per_row(shape: Sequence[int], fmt: Format) -> int:
    return -(-math.prod(tuple(shape)[fmt.axis :]) // fmt.block) if shape else 1


def codes_shape(shape: Sequence[int], fmt: Format) -> tuple[int, ...]:
    """The shape of the codes of an array of ``shape`` in ``fmt``.

    8-bit codes have the array's shape. 4-bit codes are each row's bytes:
    ``shape[:axis] + (ceil(row / 2),)``, the row's second half in the high
    nibbles of its first half's bytes.

    Example:
        >>> codes_shape((96, 96), Format(4, True, 0, 128)), codes_shape((8, 1024), Format(4, True, 1, 128))
        ((4608,), (8, 512))
    """
    shape = tuple(shape)
    if fmt.bits == 8 or not shape:
        return shape
    return (*shape[: fmt.axis], -(-math.prod(shape[fmt.axis :]) // 2))


def scales_shape(shape: Sequence[int], fmt: Format) -> tuple[int, ...]:
    """The shape of the scales of an array of ``shape`` in ``fmt``: one per block, by the axes before the blocks.

    Example:
        >>> scales_shape((128, 64), Format(8, True, 0, 256)), scales_shape((64, 4, 64), Format(8, True, 1, 256))
        ((32,), (64, 1))
    """
    shape = tuple(shape)
    if not shape:
        return ()
    return (*shape[: fmt.axis], _blocks_per_row(shape, fmt))


def check_bits(bits: Any) -> None:
    if bits not in (8, 4) or isinstance(bits, bool):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}.")


# -- where a shard may cut -------------------------------------------------------------------------


def partition_entries(
    shape: Sequence[int], fmt: Format, param_spec: PartitionSpec, axis_sizes: Mapping[str, int] | None
) -> tuple[PartitionSpec, PartitionSpec]:
    """The partition specs of the codes and of the scales of an array of ``shape`` whose spec is ``param_spec``.

    8-bit codes take the param's spec; 4-bit codes keep only the axes before
    their rows. The scales keep those too, and the entry of the axis blocks
    start on where every shard holds whole blocks: with ``axis_sizes``, the
    mesh axes' sizes, that is checked; without them it is dropped.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> fmt = Format(8, True, 1, 256)
        >>> partition_entries((64, 512), fmt, P("data", "model"), {"data": 8, "model": 2}) == (P("data", "model"),) * 2
        True
        >>> partition_entries((64, 512), fmt, P("data", "model"), None) == (P("data", "model"), P("data"))
        True
    """
    shape = tuple(shape)
    entries = _padded(param_spec, len(shape))
    if not shape:
        return PartitionSpec(), PartitionSpec()
    codes = entries if fmt.bits == 8 else entries[: fmt.axis]  # 4-bit bytes pair the two halves of a row
    return spec_of_entries(codes), uncut_spec(shape, fmt, param_spec, axis_sizes)


def uncut_spec(
    shape: Sequence[int], fmt: Format, spec: PartitionSpec, axis_sizes: Mapping[str, int] | None
) -> PartitionSpec:
    """``spec`` without the entries that cut a block (or, at 4 bits, a row): the layout the codec computes in.

    ``spec`` is that of an array of ``shape`` in ``fmt``, of its 8-bit codes,
    of its 4-bit codes or of its scales (the entries of the axes before the
    blocks are one position each in all of them). It keeps those entries, and
    that of the axis the blocks start on where every shard holds whole blocks
    (checked against ``axis_sizes``, the mesh axes' sizes: without them it is
    dropped). It is the scales' spec, and under JAX's explicit mesh axes the
    codec's reshapes into blocks are refused on any layout that cuts more.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> fmt = Format(8, True, 1, 256)
        >>> uncut_spec((64, 512), fmt, P("data", "model"), {"data": 2, "model": 2}) == P("data", "model")
        True
        >>> uncut_spec((64, 512), fmt, P("data", "model"), {"data": 2, "model": 4}) == P("data")
        True
    """
    shape = tuple(shape)
    j = fmt.axis
    entries = _padded(spec, max(len(shape), j + 1))
    if not shape:
        return PartitionSpec()
    at_blocks = entries[j] if all(e is None for e in entries[j + 1 :]) else None
    if at_blocks is not None:
        n = _shards(at_blocks, axis_sizes)
        if n is None or shape[j] % n or not _splits_whole(shape, fmt, j, n):
            at_blocks = None
    return spec_of_entries([*entries[:j], at_blocks])


def zero_axes(
    shape: Sequence[int],
    fmt: Format,
    param_spec: PartitionSpec,
    shards: int,
    axis_sizes: Mapping[str, int] | None = None,
) -> list[int]:
    """The axes of an array of ``shape`` a ZeRO shard of ``1 / shards`` may take, keeping whole blocks and bytes.

    An axis the parameter's spec leaves whole is cut in ``shards`` parts; with
    ``axis_sizes`` (the mesh's), an axis it splits is offered too where the
    ZeRO shards combine with its mesh axes (``("model", "data")``) into parts
    that keep whole blocks. An axis before ``fmt.axis`` always keeps blocks
    whole; ``fmt.axis`` itself when each shard's rows hold whole blocks; later
    axes never.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> fmt = Format(8, True, 1, 256)   # blocks of 256 along the last axis
        >>> zero_axes((64, 512), fmt, P(), 2), zero_axes((64, 512), fmt, P(), 8), zero_axes((64, 512), fmt, P("data"), 2)
        ([0, 1], [0], [1])
        >>> row_split = Format(8, True, 0, 256)   # (512, 64): blocks span rows
        >>> zero_axes((512, 64), row_split, P("model"), 2), zero_axes((512, 64), row_split, P("model"), 2, {"model": 4})
        ([], [0])
    """
    shape = tuple(shape)
    entries = _padded(param_spec, len(shape))
    out = []
    for a in range(len(shape)):
        parts = shards * (_shards(entries[a], axis_sizes) or 0) if entries[a] is not None else shards
        if parts and shape[a] % parts == 0 and _splits_whole(shape, fmt, a, parts):
            out.append(a)
    return out


def _splits_whole(shape: tuple[int, ...], fmt: Format, axis: int, shards: int) -> bool:
    """Whether cutting ``axis`` in ``shards`` equal parts keeps every block and every byte whole."""
    row = math.prod(shape[fmt.axis :])
    piece = shape[axis] // shards * math.prod(shape[axis + 1 :])  # elements of one part, per row above
    if axis > fmt.axis or (axis == fmt.axis and (row % fmt.block or piece % fmt.block)):
        return False
    return fmt.bits == 8 or axis < fmt.axis  # 4-bit bytes pair the two halves of a row


def _padded(spec: PartitionSpec, ndim: int) -> list[Any]:
    return [*spec, *([None] * (ndim - len(spec)))][:ndim]


def _shards(entry: Any, axis_sizes: Mapping[str, int] | None) -> int | None:
    """Into how many parts ``entry`` cuts its axis; ``None`` when the sizes of its mesh axes are unknown."""
    names = axis_names_of(entry)  # () for PartitionSpec.UNCONSTRAINED: unknown too
    if not names or axis_sizes is None or any(n not in axis_sizes for n in names):
        return None
    return math.prod(axis_sizes[n] for n in names)
