"""The one checksum of state dicts, bytes and checkpoints, so that corrupted data raises instead of loading.

Two sums modulo 2**32 of each array leaf's bits (a plain one and one weighted
by position), folded over the leaves in sorted path order. Integer sums are
exact, so the result is the same for numpy and jax arrays, on host or device,
sharded or not: what is saved from devices verifies on the host and back.
:func:`matches` also reads the SHA-256 digest that earlier treeopt.t5x
versions wrote into serialized bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from treeopt._state.keys import is_key
from treeopt._state.plain import flatten_paths
from treeopt._tree.paths import Path

CHECKSUM_KEY = "checksum"
"""Top-level key of the checksum that ``flax.serialization.to_state_dict(opt)`` adds."""

_SCALARS = (bool, int, float)


def _bits(dtype: Any) -> int:
    for info in (jnp.iinfo, jnp.finfo):
        try:
            return int(info(dtype).bits)
        except ValueError:
            pass
    return jnp.dtype(dtype).itemsize * 8


_UNSIGNED = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint32}


def _widen(dtype: Any) -> Any:
    """The dtype to take the bits of: ``dtype`` itself, or an exact wider one (bool, int4, ...)."""
    if dtype == np.bool_:
        return np.dtype(np.uint8)
    if _bits(dtype) not in _UNSIGNED:
        return np.dtype(np.float32 if jnp.issubdtype(dtype, jnp.floating) else np.int32)
    return dtype


def _host_sums(x: np.ndarray) -> tuple[int, int, int]:
    if np.iscomplexobj(x):
        x = np.stack([x.real, x.imag])
    x = np.ascontiguousarray(x.astype(_widen(x.dtype), copy=False)).reshape(-1)
    w = x.view(_UNSIGNED[_bits(x.dtype)]).astype(np.uint32)
    odd = np.arange(w.size, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    return int(w.sum(dtype=np.uint32)), int((w * odd).sum(dtype=np.uint32)), int(w.size)


@jax.jit
def _device_sums(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)])
    x = x.astype(_widen(x.dtype))
    w = jax.lax.bitcast_convert_type(x, _UNSIGNED[_bits(x.dtype)]).astype(jnp.uint32)
    # The row-major position of each word, without reshaping (which a sharded array may refuse).
    position = jnp.zeros(w.shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(w.ndim)):
        position = position + jax.lax.broadcasted_iota(jnp.uint32, w.shape, dim) * jnp.uint32(stride)
        stride *= w.shape[dim]
    odd = position * jnp.uint32(2) + jnp.uint32(1)
    return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * odd, dtype=jnp.uint32)])


def _on_host(x: Any) -> bool:
    if not isinstance(x, jax.Array):
        return True
    return x.is_fully_addressable and all(
        getattr(d, "platform", None) == "cpu" for d in x.sharding.device_set
    )


def _leaf_sums(x: Any) -> tuple[int, int, int]:
    """Two sums modulo 2**32 of the bits of ``x``: a plain one (a changed word changes it)
    and one weighted by odd position factors (so does a moved word), and the word count.

    Integer sums are exact, so the result does not depend on where they run:
    host arrays in numpy, device arrays (sharded ones included) on device.
    """
    return _host_sums(np.asarray(x)) if _on_host(x) else _device_leaf_sums(x)


def _device_leaf_sums(x: jax.Array) -> tuple[int, int, int]:
    a, b = (int(v) for v in np.asarray(jax.device_get(_device_sums(x))))
    words = x.size * (2 if jnp.iscomplexobj(x) else 1) * (2 if _bits(x.dtype) == 64 else 1)
    return a, b, int(words)


def _as_array(leaf: Any) -> Any:
    """A leaf as the array whose bits are summed: Python numbers as NumPy's, typed keys as key data."""
    if isinstance(leaf, _SCALARS):
        return np.asarray(leaf)
    return jax.random.key_data(leaf) if is_key(leaf) else leaf


def checksum(flat: Mapping[Path, Any]) -> np.ndarray:
    """A ``uint32[2]`` checksum of the leaves of ``flat`` (``{path: leaf}``), folded in sorted path order.

    Arrays and Python numbers count (a number as NumPy's default dtype for
    it); ``None``, strings and other objects do not. Equal for the same values
    whether they are jax or numpy arrays, on host or device.

    Example:
        >>> import numpy as np, jax.numpy as jnp
        >>> a = checksum({("w",): jnp.arange(3.0), ("step",): 1})
        >>> b = checksum({("step",): 1, ("w",): np.arange(3.0, dtype=np.float32)})
        >>> bool((a == b).all()), a.dtype.name
        (True, 'uint32')
    """
    mask = 0xFFFFFFFF
    a, b = 0x811C9DC5, 0
    for path in sorted(flat):
        leaf = flat[path]
        if not (isinstance(leaf, _SCALARS) or hasattr(leaf, "dtype")):
            continue
        s1, s2, n = _leaf_sums(_as_array(leaf))
        a = (a * 0x01000193 + s1 + n) & mask
        b = (b * 0x9E3779B1 + s2) & mask
    return np.array([a, b], dtype=np.uint32)


def with_checksum(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with its :func:`checksum` added under ``"checksum"``, as serialized bytes carry it.

    Example:
        >>> sorted(with_checksum({"step": 1, "opt_state": {}}))
        ['checksum', 'opt_state', 'step']
    """
    return {**state_dict, CHECKSUM_KEY: checksum(flatten_paths(state_dict))}


def _words(stored: Any) -> list[int] | None:
    try:
        return np.asarray(stored, dtype=np.uint32).reshape(-1).tolist()
    except (TypeError, ValueError):
        return None


def matches(values: Mapping[Path, Any], stored: Any, nested: Any = None) -> bool:
    """Whether ``stored`` is the checksum of ``values`` (``{path: leaf}``); ``None`` stored matches.

    ``stored`` is :func:`checksum`'s two words. Four words are the SHA-256
    digest earlier treeopt.t5x versions wrote into serialized bytes: given the
    ``nested`` state dict they were computed over, they are checked instead.

    Example:
        >>> import numpy as np
        >>> values = {("w",): np.ones(2, np.float32)}
        >>> matches(values, checksum(values)), matches(values, [1, 2]), matches(values, None)
        (True, False, True)
    """
    if stored is None:
        return True
    words = _words(stored)
    if words is not None and len(words) == _LEGACY_WORDS and nested is not None:
        return words == _legacy_digest(nested).tolist()
    return words == checksum(values).tolist()


# -- the digest of earlier treeopt.t5x bytes: read, never written --------------------------------

_LEGACY_WORDS = 4


def _records(tree: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    if isinstance(tree, Mapping):
        if not tree:
            yield path, {}
        for key in sorted(tree, key=str):
            yield from _records(tree[key], (*path, str(key)))
    else:
        yield path, tree


def _legacy_digest(state_dict: Any) -> np.ndarray:
    """The ``uint32[4]`` SHA-256 digest (truncated) of paths, dtypes, shapes and values that
    treeopt.t5x wrote into serialized bytes before :func:`checksum` was the only one."""
    digest = hashlib.sha256()
    for path, leaf in _records(state_dict):
        digest.update(repr(path).encode())
        if leaf is None or isinstance(leaf, (bool, int, float, complex, str, bytes, dict)):
            digest.update(f"{type(leaf).__name__}:{leaf!r}".encode())
            continue
        array = np.asarray(leaf)
        digest.update(f"{array.dtype.name}{list(array.shape)}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return np.frombuffer(digest.digest()[:16], dtype=np.uint32).copy()
