"""Low-bit state dicts written before the format was recorded (version 1): their bits, layout and levels.

Those codes carry no ``format`` entry: the bits are read from the shapes of
codes and scales (where both readings fit, from the codes themselves), the
blocks ran along the last axis, and the map was chosen per block by the sign
of its scale. :func:`legacy_decoded` reads them as floats, which a warm start
or a load then encodes in today's format.

Example:
    >>> import numpy as np
    >>> legacy_bits(np.zeros((4, 64), np.uint8), np.ones((4, 1), np.float32), (4, 64))
    8
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["legacy_bits", "legacy_decoded"]



def legacy_bits(codes: Any, scales: Any, shape: tuple[int, ...]) -> int | None:
    """The bits of codes without a ``format``: from their shapes where only one reading fits.

    Where both fit (a last axis of 1), the codes themselves tell.
    """
    given = (tuple(np.shape(codes)), tuple(np.shape(scales)))
    fits = [bits for bits in (8, 4) if _legacy_shapes(shape, bits) == given]
    if len(fits) == 2:
        # A last axis of 1: each block is one element, its own maximum, so 8-bit codes are 0 or 255 and
        # 4-bit bytes 0 or 15; where all are 0, both readings give the same values.
        return 8 if bool(np.any(np.asarray(codes) > 15)) else 4
    return fits[0] if fits else None


def _legacy_block(last: int, bits: int) -> int:
    if last <= 256:
        block = max(last, 1)
        return block + block % 2 if bits == 4 else block
    step = 2 if bits == 4 else 1
    for block in range(256, 63, -step):
        if last % block == 0:
            return block
    return 256


def _legacy_shapes(shape: tuple[int, ...], bits: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if not shape:
        return (), ()
    last = shape[-1]
    block = _legacy_block(last, bits)
    codes_last = last if bits == 8 else -(-last // 2)
    return (*shape[:-1], codes_last), (*shape[:-1], -(-last // block))


def legacy_decoded(codes: Any, scales: Any, shape: tuple[int, ...], dtype: Any, bits: int) -> jax.Array:
    """Codes of the first layout (blocks along the last axis, map chosen per block by the sign of its scale) as floats.

    Example:
        >>> import numpy as np
        >>> float(legacy_decoded(np.array([255], np.uint8), np.array([-2.0], np.float32), (1,), np.float32, 8)[0])
        2.0
    """
    codes, scales = np.asarray(codes), np.asarray(scales, np.float32)
    rows = codes.reshape(-1, codes.shape[-1]) if codes.ndim else codes.reshape(1, 1)
    last = shape[-1] if shape else 1
    if bits == 4:
        rows = np.stack([rows & 0xF, rows >> 4], axis=-1).reshape(rows.shape[0], -1)[:, :last]
    block = _legacy_block(last, bits)
    n_blocks = -(-last // block)
    padded = np.zeros((rows.shape[0], n_blocks * block), np.int64)
    padded[:, :last] = rows
    scale = scales.reshape(rows.shape[0], n_blocks, 1)
    unsigned = np.signbit(scale)
    table = _legacy_levels(bits)
    index = padded.reshape(rows.shape[0], n_blocks, block) + np.where(unsigned, 2**bits, 0)
    values = table[index] * np.abs(scale)
    values = values.reshape(rows.shape[0], n_blocks * block)[:, :last]
    return jnp.asarray(values.reshape(shape).astype(dtype))


def _legacy_levels(bits: int) -> np.ndarray:
    def dynamic(n: int) -> np.ndarray:
        return np.concatenate(
            [10.0 ** (i - n + 1) * np.linspace(0.1, 1.0, 2**i + 1)[1:] for i in range(n)]
        )

    magnitudes = dynamic(bits - 1)
    signed = np.concatenate([-magnitudes[::-1], [0.0], magnitudes, [1.0]])
    unsigned = np.concatenate([[1e-8], dynamic(8)]) if bits == 8 else np.linspace(0.0, 1.0, 17)[1:]
    return np.concatenate([signed, unsigned]).astype(np.float32)

