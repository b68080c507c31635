"""Checkpoints that another library wrote, told apart from damaged ones: a flax ``nnx.Optimizer``'s.

A user moving to ``treeopt.nnx`` brings checkpoints of ``nnx.Optimizer`` (or
``nnx.ModelAndOptimizer``), written by orbax as flax's guide does: the state
``nnx.state(optimizer)`` saved whole (each array an nnx ``Variable``, under
``.../value``) or as ``nnx.to_pure_dict``, alone in the directory or as an
item of a manager's step. Its layout is not treeopt's: nnx nests each
parameter's state by module and counts steps in ``uint32``, treeopt keys it
by the parameter's full name and counts in ``int32``. Such a checkpoint is
recognized by its step and its top-level keys, and refused with an error
that says so and points to the migration (``warm_start``), rather than
reported as damaged or as a list of every path that differs.

Example:
    >>> import numpy as np
    >>> nnx_state = {"step": np.zeros((), np.uint32), "opt_state": {"0": {"mu": {"layer": {"w": np.ones(2)}}}}}
    >>> nnx_optimizer_signs(nnx_state)
    ['its step is uint32, as nnx.Optimizer counts']
    >>> nnx_optimizer_signs({"step": np.zeros((), np.int32), "opt_state": {"0": {"mu": {"layer/w": np.ones(2)}}}})
    []
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from treeopt.errors import StateDictError

_NNX_KEYS = frozenset({"step", "opt_state"})
_MODEL_KEY = "model"  # nnx.ModelAndOptimizer holds its model beside the optimizer's state
_VARIABLE_VALUE = "value"  # an nnx Variable saved whole: its array under this key


def nnx_optimizer_signs(tree: Any) -> list[str]:
    """Why ``tree`` (a saved item's tree, of arrays or orbax metadata) is an ``nnx.Optimizer``'s state; [] if not."""
    if not isinstance(tree, Mapping) or not _NNX_KEYS <= set(tree) <= _NNX_KEYS | {_MODEL_KEY}:
        return []
    step = tree["step"]
    signs = []
    if isinstance(step, Mapping) and set(step) == {_VARIABLE_VALUE}:
        step = step[_VARIABLE_VALUE]
        signs.append(f"each array is an nnx Variable saved whole, under '.../{_VARIABLE_VALUE}'")
    dtype = getattr(step, "dtype", None)
    if dtype is not None and np.dtype(dtype) == np.uint32:
        signs.insert(0, "its step is uint32, as nnx.Optimizer counts")
    if signs and _MODEL_KEY in tree:
        signs.append(f"it holds a '{_MODEL_KEY}' beside the optimizer, as nnx.ModelAndOptimizer does")
    return signs


def nnx_optimizer_error(where: str, signs: list[str]) -> StateDictError:
    """The error of restoring the ``nnx.Optimizer`` checkpoint at ``where`` (``signs``: how it was told)."""
    return StateDictError(
        f"The checkpoint at {where} holds the state of a flax nnx.Optimizer ({'; '.join(signs)}), not a "
        "treeopt optimizer's: it does not restore into a treeopt optimizer (treeopt.nnx.Optimizer "
        "included) as it is. nnx nests each parameter's state by module ({'hidden': {'kernel': ...}}) "
        "and counts steps in uint32; treeopt keys it by the parameter's full name ('hidden/kernel') and "
        "counts in int32. Migrate it once: read it with orbax as a pure dict (nnx.to_pure_dict's "
        "layout, no '.../value' level), key it by name and load it with "
        "treeopt.serialization.warm_start, as docs/migration/from-nnx.md shows (\"From an nnx.Optimizer "
        "checkpoint\"); then save with treeopt.checkpoint."
    )


def single_item_tree(where: str) -> Any:
    """The tree of the single-item orbax checkpoint at ``where`` (``StandardCheckpointer``'s), else None."""
    import orbax.checkpoint as ocp  # imported on first use: it costs ~0.5 s

    checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    try:
        metadata = checkpointer.metadata(where).item_metadata
    except Exception:  # not a single-item checkpoint either: the caller's error stands
        return None
    finally:
        checkpointer.close()
    return getattr(metadata, "tree", metadata)
