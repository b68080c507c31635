"""State dicts of the T5X surface: T5X's layout, restored through the core's state-dict engine.

T5X writes ``{"target": ..., "state": {"step": ..., "param_states": ...}}``
with ``flax.serialization.to_state_dict`` and, for optax states, leaves out
the empty dicts of ``optax.EmptyState``/``optax.MaskedNode``. :func:`restore`
reads that layout back into a template by name, with the engine's by-kind
policy: values are kept as given (T5X's ``from_state_dict``) once each has the
kind (integer, float, ...) and shape of the template's leaf; missing or
unexpected entries, ``None`` or strings where a value is expected are listed,
by path, in one :class:`treeopt.serialization.StateDictError`. Empty entries
hold no leaves, so the ones T5X leaves out come back from the template.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.serialization
import jax
from flax import traverse_util

from treeopt.errors import StateDictError, describe
from treeopt.internal import BY_KIND, Messages, StateDictSource, Target, load, refuse_a_negative_step
from treeopt.keys import key_data
from treeopt.serialization import CHECKSUM_KEY

_PARTS = ("target", "state")
_MISMATCH = Messages(lead="The state dict does not match this optimizer", hint="", warning="")

# -- writing --------------------------------------------------------------------------


def drop_empty_dicts(tree: Any) -> Any:
    """``tree`` without its empty dicts (recursively: a dict left empty goes too), as T5X writes state.

    Example:
        >>> drop_empty_dicts({"0": {"count": 1, "mu": {}}, "1": {}, "2": {"a": {}}})
        {'0': {'count': 1}}
    """
    if not isinstance(tree, dict):
        return tree
    return traverse_util.unflatten_dict(traverse_util.flatten_dict(tree))


def to_state_dict(tree: Any) -> Any:
    """``flax.serialization.to_state_dict``, typed PRNG keys written as their ``uint32`` key data.

    Example:
        >>> import jax
        >>> to_state_dict({"key": jax.random.key(0)})["key"].dtype
        dtype('uint32')
    """
    return jax.tree.map(key_data, flax.serialization.to_state_dict(tree))


# -- reading --------------------------------------------------------------------------


def check_parts(state_dict: Any, allowed_others: bool) -> None:
    """Refuses what is not ``{"target": ..., "state": ...}``: another type, a missing part, and
    (unless ``allowed_others``, as T5X's ``flax_mutables``) other top-level keys but the checksum.

    Example:
        >>> check_parts({"target": {}, "state": {}, "checksum": [1, 2]}, allowed_others=False)
        >>> try:
        ...     check_parts({"target": {}, "stat": {}}, allowed_others=True)
        ... except StateDictError as e:
        ...     print(e)
        The optimizer's state dict has no ['state'] entry (its keys: ['stat', 'target']).
    """
    if not isinstance(state_dict, Mapping):
        raise StateDictError(
            f"Expected the optimizer's state dict {{'target': ..., 'state': ...}}, got {describe(state_dict)}."
        )
    missing = [key for key in _PARTS if key not in state_dict]
    if missing:
        raise StateDictError(
            f"The optimizer's state dict has no {missing} entry (its keys: {sorted(map(str, state_dict))})."
        )
    unknown = sorted(str(k) for k in state_dict if k not in (*_PARTS, CHECKSUM_KEY))
    if unknown and not allowed_others:
        raise StateDictError(
            f"The optimizer's state dict has unexpected top-level entries {unknown}; "
            f"expected {list(_PARTS)} (and '{CHECKSUM_KEY}')."
        )


def restore(target: Any, state: Any, state_dict: Mapping[str, Any]) -> tuple[Any, Any]:
    """``(target, state)`` with their values from ``state_dict``, checked and verified by the engine.

    ``target`` and ``state`` are any pytrees with flax serialization (concrete
    or from ``jax.eval_shape``). The state dict's ``"checksum"``, where it has
    one (bytes treeopt.t5x wrote; T5X writes none), is verified.

    Example:
        >>> import numpy as np
        >>> restore({"w": np.zeros(2, np.float32)}, {"step": 0}, {"target": {"w": np.ones(2, np.float32)},
        ...                                                         "state": {"step": 3}})
        ({'w': array([1., 1.], dtype=float32)}, {'step': 3})
        >>> try:
        ...     restore({"w": np.zeros(2, np.float32)}, {}, {"target": {"w": np.ones(2, np.int32)}, "state": {}})
        ... except StateDictError as e:
        ...     print(e)
        The state dict does not match this optimizer:
        shape/dtype mismatch (1):
          target/w: expected float32[2] (float), got int32[2] (integer)
    """
    check_parts(state_dict, allowed_others=True)
    refuse_a_negative_step(state_dict.get("state"), _MISMATCH.lead, path="state/step")
    parts = {key: state_dict[key] for key in (*_PARTS, CHECKSUM_KEY) if key in state_dict}
    template = Target.of({"target": target, "state": state}, plain=to_state_dict)
    source = StateDictSource(parts, caller="restore_state", name="optimizer")
    restored, _ = load(template, source, BY_KIND, _MISMATCH)
    return restored["target"], restored["state"]
