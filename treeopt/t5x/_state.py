"""State dicts of the T5X surface: T5X's layout, checked restores, and a checksum for flax bytes.

T5X writes ``{"target": ..., "state": {"step": ..., "param_states": ...}}``
with ``flax.serialization.to_state_dict`` and, for optax states, leaves out
the empty dicts of ``optax.EmptyState``/``optax.MaskedNode``. :func:`restore`
reads that layout back into a template (putting the empty entries back) and
refuses what would load wrongly or silently: missing or unexpected entries,
shape mismatches, a value of another kind (an integer where a float is
expected), ``None`` where a value is expected, strings. All such paths are
listed in one :class:`treeopt.serialization.StateDictError`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np

from treeopt.errors import StateDictError, describe
from treeopt.keys import key_data, wrap_key_like
from treeopt.serialization import CHECKSUM_KEY

# -- writing --------------------------------------------------------------------------


def drop_empty_dicts(tree: Any) -> Any:
    """``tree`` without its empty dicts (recursively: a dict left empty goes too), as T5X writes state.

    Example:
        >>> drop_empty_dicts({"0": {"count": 1, "mu": {}}, "1": {}, "2": {"a": {}}})
        {'0': {'count': 1}}
    """
    if not isinstance(tree, dict):
        return tree
    out = {}
    for key, value in tree.items():
        value = drop_empty_dicts(value)
        if isinstance(value, dict) and not value:
            continue
        out[key] = value
    return out


def _wrap_key(template: Any, value: Any) -> Any:
    # T5X's from_state_dict keeps what it is given for abstract templates.
    return wrap_key_like(template, value) if isinstance(template, jax.Array) else value


def to_state_dict(tree: Any) -> Any:
    """``flax.serialization.to_state_dict``, typed PRNG keys written as their ``uint32`` key data.

    Example:
        >>> import jax
        >>> to_state_dict({"key": jax.random.key(0)})["key"].dtype
        dtype('uint32')
    """
    return jax.tree.map(key_data, flax.serialization.to_state_dict(tree))


# -- checked restore ----------------------------------------------------------------------


def _kind(dtype: Any) -> str:
    """The class of values a dtype holds: what a restore may not change."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return "PRNG key"
    if dtype == np.bool_:
        return "bool"
    if jnp.issubdtype(dtype, jnp.integer):
        return "integer"
    if jnp.issubdtype(dtype, jnp.floating):
        return "float"
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return "complex"
    return "other"


def _value_kind(x: Any) -> tuple[str, tuple[int, ...]] | None:
    """``(kind, shape)`` of a restorable value, or None for what is not one (strings, objects)."""
    if isinstance(x, bool):
        return "bool", ()
    if isinstance(x, int):
        return "integer", ()
    if isinstance(x, float):
        return "float", ()
    if isinstance(x, complex):
        return "complex", ()
    dtype, shape = getattr(x, "dtype", None), getattr(x, "shape", None)
    if dtype is None or shape is None:
        return None
    try:
        kind = _kind(dtype)
    except TypeError:
        return None
    return (None if kind == "other" else kind, tuple(shape))  # type: ignore[return-value]


class _Problems:
    """What a restore found wrong, by path, as a :class:`~treeopt.errors.LoadReport` lists it."""

    def __init__(self) -> None:
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.mismatched: list[tuple[str, str, str]] = []

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched)


def _check_leaf(template: Any, given: Any, path: str, problems: _Problems) -> None:
    expected = _value_kind(template)
    if expected is None:
        if template is None and given is not None:
            problems.mismatched.append((path, "no value (None)", describe(given)))
        return  # a template leaf that is no array (an object the state holds as is)
    kind, shape = expected
    got = _value_kind(given)
    if got is None or got[0] is None:
        problems.mismatched.append((path, f"{describe(template)} ({kind})", describe(given)))
        return
    if got[0] != kind:
        problems.mismatched.append((path, f"{describe(template)} ({kind})", f"{describe(given)} ({got[0]})"))
    elif got[1] != shape:
        problems.mismatched.append((path, describe(template), describe(given)))


def _has_data(tree: Any) -> bool:
    if isinstance(tree, dict):
        return any(_has_data(v) for v in tree.values())
    return tree is not None


def _leaf_paths(tree: Any, prefix: str) -> list[str]:
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in _leaf_paths(v, f"{prefix}/{k}")]
    return [prefix] if tree is not None else []


def _fill(template: Any, given: Any, path: str, problems: _Problems) -> Any:
    """``given`` with the empty entries of ``template`` put back; problems collected by path."""
    if isinstance(template, dict):
        if not isinstance(given, Mapping):
            if _has_data(template) or given is not None:
                problems.mismatched.append((path, "a dict of entries", describe(given)))
            return template if given is None else given
        names = {str(k) for k in template}
        out = {}
        for key, sub in template.items():
            key = str(key)
            if key in given:
                out[key] = _fill(sub, given[key], f"{path}/{key}", problems)
            elif _has_data(sub):
                problems.missing.extend(_leaf_paths(sub, f"{path}/{key}"))
            else:
                out[key] = sub
        problems.unexpected.extend(
            f"{path}/{key}" for key in sorted(str(k) for k in given) if key not in names
        )
        return out
    _check_leaf(template, given, path, problems)
    return given


def restore(*entries: tuple[Any, Any, str]) -> list[Any]:
    """Each ``(template, state_dict, path)``: the template with its values from the state dict.

    ``template`` is any pytree with flax serialization (concrete or from
    ``jax.eval_shape``). Empty entries T5X drops when writing
    (``optax.EmptyState``, ``optax.MaskedNode``) are put back. Values are kept
    as given (T5X's ``from_state_dict``), after checking each against the
    template: every missing entry, unexpected entry, shape mismatch, value of
    another kind (integer for float, ``None``, a string) of all the entries is
    listed, by path, in one :class:`~treeopt.serialization.StateDictError`.

    Example:
        >>> import numpy as np
        >>> restore(({"w": np.zeros(2, np.float32)}, {"w": np.ones(2, np.float32)}, "target"))
        [{'w': array([1., 1.], dtype=float32)}]
        >>> from treeopt.serialization import StateDictError
        >>> try:
        ...     restore(({"w": np.zeros(2, np.float32)}, {"w": np.ones(2, np.int32)}, "target"))
        ... except StateDictError as e:
        ...     print(e)
        The state dict does not match this optimizer:
        shape/dtype mismatch (1):
          target/w: expected float32[2] (float), got int32[2] (integer)
    """
    problems = _Problems()
    filled = []
    for template, state_dict, path in entries:
        filled.append(_fill(to_state_dict(template), state_dict, path, problems))
    if problems:
        raise StateDictError.between(
            "The state dict does not match this optimizer",
            missing=problems.missing,
            unexpected=problems.unexpected,
            mismatched=problems.mismatched,
        )
    restored = [
        flax.serialization.from_state_dict(t, f) for (t, _, _), f in zip(entries, filled, strict=True)
    ]
    return [jax.tree.map(_wrap_key, t, r) for (t, _, _), r in zip(entries, restored, strict=True)]


# -- checksum of flax bytes -------------------------------------------------------------------


def _records(tree: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    if isinstance(tree, Mapping):
        if not tree:
            yield path, {}
        for key in sorted(tree, key=str):
            yield from _records(tree[key], (*path, str(key)))
    else:
        yield path, tree


def checksum(state_dict: Mapping[str, Any]) -> np.ndarray:
    """A ``uint32[4]`` digest (SHA-256, truncated) of a state dict's paths, dtypes, shapes and values.

    The same for the state dict an optimizer writes and the one msgpack reads
    back (jax or numpy arrays, host or device).

    Example:
        >>> import numpy as np, jax.numpy as jnp
        >>> a = checksum({"w": jnp.arange(3.0), "step": 1})
        >>> b = checksum({"step": 1, "w": np.arange(3.0, dtype=np.float32)})
        >>> bool((a == b).all()), a.dtype.name, a.shape
        (True, 'uint32', (4,))
    """
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


def with_checksum(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with a top-level ``"checksum"`` of its contents added.

    Example:
        >>> sorted(with_checksum({"target": {}, "state": {"step": 0}}))
        ['checksum', 'state', 'target']
    """
    return {**state_dict, CHECKSUM_KEY: checksum(state_dict)}


def verify_checksum(state_dict: Mapping[str, Any], allowed: tuple[str, ...]) -> dict[str, Any]:
    """``state_dict`` without its checksum, which must match its contents (if it has one).

    Top-level keys other than ``allowed`` (and the checksum) are refused: a
    corrupted key would otherwise be ignored.

    Example:
        >>> sd = with_checksum({"target": {"w": 1.0}, "state": {"step": 0}})
        >>> sorted(verify_checksum(sd, ("target", "state")))
        ['state', 'target']
        >>> sd["state"]["step"] = 1
        >>> from treeopt.serialization import StateDictError
        >>> try:
        ...     verify_checksum(sd, ("target", "state"))
        ... except StateDictError as e:
        ...     print(str(e).split(":")[0])
        The optimizer's checksum does not match its data
    """
    if not isinstance(state_dict, Mapping):
        raise StateDictError(f"Expected the optimizer's state dict (a dict), got {describe(state_dict)}.")
    unknown = sorted(str(k) for k in state_dict if k not in (*allowed, CHECKSUM_KEY))
    if unknown:
        raise StateDictError(
            f"The optimizer's state dict has unexpected top-level entries {unknown}; "
            f"expected {list(allowed)} (and '{CHECKSUM_KEY}')."
        )
    rest = {k: v for k, v in state_dict.items() if k != CHECKSUM_KEY}
    if CHECKSUM_KEY not in state_dict:
        return rest
    try:
        stored = np.asarray(state_dict[CHECKSUM_KEY]).astype(np.uint32, casting="safe").reshape(-1).tolist()
    except (TypeError, ValueError):
        stored = None
    if stored != checksum(rest).tolist():
        raise StateDictError(
            "The optimizer's checksum does not match its data: it is corrupted (or was edited "
            f"after it was saved). To load a deliberately edited state dict, delete its "
            f"'{CHECKSUM_KEY}' entry first."
        )
    return rest


__all__ = [
    "CHECKSUM_KEY",
    "checksum",
    "drop_empty_dicts",
    "restore",
    "to_state_dict",
    "verify_checksum",
    "with_checksum",
]
