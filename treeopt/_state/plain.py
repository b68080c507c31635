"""The plain form of state: nested dicts with string keys.

``flax.serialization.to_state_dict`` turns optax's NamedTuple states into
dicts keyed by field name (``"mu"``, ``"count"``), tuples (``optax.chain``)
into dicts keyed by position (``"0"``, ``"1"``), ``optax.EmptyState`` and
``optax.MaskedNode`` into empty dicts. Typed PRNG keys are written as their
``uint32`` key data. The leaves of the plain form by path are
:func:`flatten_paths`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import flax.serialization
import jax

from treeopt._state.keys import key_data
from treeopt._tree.paths import Path


def _entry_str(entry: Any) -> str:
    return jax.tree_util.keystr((entry,), simple=True, separator="/")


def to_plain(tree: Any) -> Any:
    """``tree`` as nested plain dicts with string keys, leaves unchanged but for PRNG keys.

    ``flax.serialization.to_state_dict`` does the work; a pytree node flax does
    not know becomes a dict keyed by its ``jax.tree_util`` key entries.

    Example:
        >>> import optax, jax.numpy as jnp
        >>> to_plain(optax.adam(0.1).init({"w": jnp.zeros(2)}))["0"]["mu"]
        {'w': Array([0., 0.], dtype=float32)}
    """
    return _plainify(flax.serialization.to_state_dict(tree))


def _plainify(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _plainify(v) for k, v in x.items()}
    if x is None or jax.tree_util.treedef_is_leaf(jax.tree.structure(x)):
        return key_data(x)
    # A pytree node flax.serialization does not know: key it by its key path.
    out: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(x)[0]:
        node = out
        keys = [_entry_str(e) for e in path]
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1] if keys else "0"] = key_data(leaf)
    return out


def flatten_paths(state_dict: Any, prefix: Path = (), keep_none: bool = False) -> dict[Path, Any]:
    """``{path: leaf}`` of a nested state dict; empty dicts and ``None`` hold no leaves.

    Lists and tuples (as some readers return them) are keyed by position. With
    ``keep_none``, ``None`` values are kept as leaves (so that loading can say
    that a leaf is ``None`` rather than missing).

    Example:
        >>> flatten_paths({"step": 1, "opt_state": {"0": {"mu": {"a/b": 2}}, "1": {}}})
        {('step',): 1, ('opt_state', '0', 'mu', 'a/b'): 2}
    """
    out: dict[Path, Any] = {}
    if isinstance(state_dict, Mapping):
        items: Iterable[tuple[Any, Any]] = state_dict.items()
    elif isinstance(state_dict, (list, tuple)) and not hasattr(state_dict, "_fields"):
        items = enumerate(state_dict)
    else:
        return {prefix: state_dict} if state_dict is not None or keep_none else {}
    for key, value in items:
        out.update(flatten_paths(value, (*prefix, str(key)), keep_none))
    return out
