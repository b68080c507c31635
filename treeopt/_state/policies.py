"""A slot of the state-dict engine's target, and what a value must be to fill it: a :class:`Policy`.

The core loads the same shape and dtype (:data:`EXACT`); a warm start also
casts a narrower float up (:data:`EXACT_OR_WIDER`); T5X loads any value of the
right kind and shape as given (:data:`BY_KIND`).

Example:
    >>> import numpy as np
    >>> slot = slot_of(0, np.zeros(3, np.float32))
    >>> EXACT.misfit(slot, np.zeros(3, np.float32)), EXACT.misfit(slot, np.zeros(3, np.float64))
    (None, ('float32[3]', 'float64[3]'))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from treeopt._state.keys import is_key, wrap_key_like
from treeopt.errors import describe, dtype_name

__all__ = ["BY_KIND", "EXACT", "EXACT_OR_WIDER", "Policy", "Slot", "slot_of", "widens"]

_SCALARS = (bool, int, float)


@dataclasses.dataclass(frozen=True)
class Slot:
    """One leaf of a target tree, as a source must provide it."""

    index: int  # position among the target's leaves
    leaf: Any  # the target's leaf (array, ShapeDtypeStruct, number, ...)
    shape: tuple[int, ...]  # the shape expected in the source (key data for keys)
    dtype: Any  # the dtype expected in the source (uint32 for keys)

    @property
    def expected(self) -> str:
        return f"{dtype_name(self.dtype)}{list(self.shape)}"

    @property
    def abstract(self) -> bool:
        return isinstance(self.leaf, jax.ShapeDtypeStruct)

    @property
    def sharding(self) -> Any:
        if isinstance(self.leaf, jax.core.Tracer):
            return None
        return getattr(self.leaf, "sharding", None)


def slot_of(index: int, leaf: Any) -> Slot:
    """The slot of the target's leaf ``leaf`` at ``index``: what a source must hold for it."""
    if is_key(leaf):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        return Slot(index, leaf, tuple(data.shape), np.dtype(data.dtype))
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return Slot(index, leaf, tuple(leaf.shape), leaf.dtype)
    try:
        return Slot(index, leaf, tuple(np.shape(leaf)), np.result_type(leaf))
    except TypeError:  # an object the tree holds as it is: no dtype
        return Slot(index, leaf, (), None)


def _scalar_misfit(slot: Slot, value: bool | int | float) -> str | None:
    """Why a Python number cannot load into ``slot`` without losing part of it (None: it can)."""
    dtype = np.dtype(slot.dtype)
    if slot.shape != () or is_key(slot.leaf) or dtype.kind not in "biuf":
        return describe(value)
    if (dtype.kind == "b") != isinstance(value, bool):
        return f"{describe(value)} ({'a bool' if isinstance(value, bool) else 'not a bool'})"
    if dtype.kind in "iu":
        if isinstance(value, float) and not (np.isfinite(value) and value == int(value)):
            return f"{describe(value)} (not an integer)"
        info = np.iinfo(dtype)
        if not info.min <= int(value) <= info.max:
            return f"{describe(value)} (outside the {dtype.name} range [{info.min}, {info.max}])"
    elif dtype.kind == "f":
        try:
            x = float(value)
        except OverflowError:  # an int beyond float64
            x = None
        with np.errstate(over="ignore"):
            overflows = x is None or (np.isfinite(x) and not np.isfinite(np.asarray(x).astype(dtype)))
        if overflows:
            big = float(jnp.finfo(dtype).max)
            return f"{describe(value)} (outside the {dtype.name} range [{-big:g}, {big:g}])"
    return None


def _exact_got(slot: Slot, value: Any) -> str | None:
    """Why ``value`` is not exactly what ``slot`` holds, as the "got ..." of an error (None: it is)."""
    if isinstance(value, _SCALARS) and not isinstance(value, np.generic):
        return _scalar_misfit(slot, value)
    if value is None or not (hasattr(value, "shape") and hasattr(value, "dtype")):
        return describe(value)
    if is_key(value):
        if is_key(slot.leaf) and value.dtype == slot.leaf.dtype and value.shape == slot.leaf.shape:
            return None
        return describe(value)
    if tuple(value.shape) == slot.shape and dtype_name(value.dtype) == dtype_name(slot.dtype):
        return None
    return describe(value)


def _exact_value(slot: Slot, value: Any, copy: bool) -> Any:
    """``value`` as the target leaf is: its dtype, key type and sharding.

    With ``copy``, a concrete ``jax.Array`` is never returned as it is (nor
    placed by aliasing it): donating the result leaves ``value`` alive.
    """
    sharding = slot.sharding
    if sharding is not None and isinstance(slot.leaf, jax.Array) and not slot.leaf.committed:
        # A leaf of a plain init is uncommitted: committing the loaded one to one device
        # would make jit refuse it beside params placed on a mesh.
        sharding = None
    alias = copy and isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer)
    if is_key(slot.leaf):
        value = wrap_key_like(slot.leaf, value)
    elif isinstance(value, _SCALARS) and not isinstance(value, np.generic):
        value = np.asarray(value, dtype=slot.dtype)
    elif widens(slot, value):
        value, alias = value.astype(slot.dtype), False  # a new buffer already
    if isinstance(value, jax.core.Tracer):
        return value
    if sharding is not None:
        return jax.device_put(value, sharding, may_alias=False) if alias else jax.device_put(value, sharding)
    if alias:
        return jnp.array(value, copy=True)
    return value if isinstance(value, jax.Array) else jnp.asarray(value)


def _exact_misfit(slot: Slot, value: Any) -> tuple[str, str] | None:
    got = _exact_got(slot, value)
    return None if got is None else (slot.expected, got)


def widens(slot: Slot, value: Any) -> bool:
    """Whether ``value`` is a narrower floating array that ``slot``'s dtype holds exactly."""
    dtype = getattr(value, "dtype", None)
    if (
        dtype is None
        or is_key(value)
        or slot.dtype is None
        or tuple(getattr(value, "shape", ())) != slot.shape
    ):
        return False
    both_float = jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(slot.dtype, jnp.floating)
    return bool(both_float) and jnp.promote_types(dtype, slot.dtype) == jnp.dtype(slot.dtype) != jnp.dtype(
        dtype
    )


def _exact_or_wider_misfit(slot: Slot, value: Any) -> tuple[str, str] | None:
    return None if widens(slot, value) else _exact_misfit(slot, value)


def _kind(dtype: Any) -> str | None:
    """The class of values a dtype holds, which a T5X restore may not change (None: not a value)."""
    try:
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            return "PRNG key"
        if dtype == np.bool_:
            return "bool"
        for kind, base in (
            ("integer", jnp.integer),
            ("float", jnp.floating),
            ("complex", jnp.complexfloating),
        ):
            if jnp.issubdtype(dtype, base):
                return kind
    except TypeError:
        pass
    return None


def _value_kind(x: Any) -> tuple[str | None, tuple[int, ...]] | None:
    """``(kind, shape)`` of a value, or ``None`` for what holds no value (strings, objects, None)."""
    if isinstance(x, complex):
        return "complex", ()
    if isinstance(x, _SCALARS):
        return _kind(np.result_type(x)), ()
    dtype, shape = getattr(x, "dtype", None), getattr(x, "shape", None)
    if dtype is None or shape is None:
        return None
    return _kind(dtype), tuple(shape)


def _kind_misfit(slot: Slot, value: Any) -> tuple[str, str] | None:
    """Why ``value`` cannot stand for ``slot`` in a T5X restore: another kind or shape (None: it can)."""
    kind = None if slot.dtype is None else _kind(slot.dtype)
    if kind is None:
        return None  # an object the state holds as it is
    got = _value_kind(value)
    if got is None or got[0] is None:
        return f"{slot.expected} ({kind})", describe(value)
    if got[0] != kind:
        return f"{slot.expected} ({kind})", f"{describe(value)} ({got[0]})"
    if got[1] != slot.shape:
        return slot.expected, describe(value)
    return None


def _value_as_given(slot: Slot, value: Any, copy: bool) -> Any:
    # T5X's from_state_dict keeps what it is given; only a concrete key template wraps key data.
    return wrap_key_like(slot.leaf, value) if isinstance(slot.leaf, jax.Array) else value


@dataclasses.dataclass(frozen=True)
class Policy:
    """What a caller of the engine loads: which values fit a slot, and what a fitting value becomes.

    Attributes:
        misfit: ``(slot, value) -> None`` when ``value`` fits, else ``(expected, got)`` for the report.
        convert: ``(slot, value, copy) -> leaf``; ``copy``: the source's arrays stay the caller's.
        legacy_digest: also verify the SHA-256 digest of earlier treeopt.t5x bytes.
        casts: fitting values of another dtype are cast to the slot's (the report lists them).
    """

    misfit: Callable[[Slot, Any], tuple[str, str] | None]
    convert: Callable[[Slot, Any, bool], Any]
    legacy_digest: bool = False
    casts: bool = False


EXACT = Policy(_exact_misfit, _exact_value)
"""The core's policy: the same shape and dtype (or a Python number that fits exactly), copied
onto the target's sharding."""

EXACT_OR_WIDER = Policy(_exact_or_wider_misfit, _exact_value, casts=True)
"""A warm start's policy: as :data:`EXACT`, and a narrower floating value is cast up (losslessly)."""

BY_KIND = Policy(_kind_misfit, _value_as_given, legacy_digest=True)
"""T5X's policy: the same shape and kind of value (integer, float, ...), kept as given."""
